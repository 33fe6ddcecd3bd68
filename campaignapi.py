"""campaignapi: an email-campaign HTTP API that any Python web application can embed.

Recipient lists (datasources), messages, segments and campaigns behind a small
JSON API under ``/v1``, stored in one SQLite file, sent through an SMTP relay.
The behaviour is the contract in ``API.md``; this module is the whole product.

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

import argparse
import base64
import binascii
import codecs
import contextlib
import csv
import datetime
import email.errors
import email.headerregistry
import email.policy
import email.utils
import hashlib
import hmac
import html
import importlib.metadata
import io
import itertools
import json
import logging
import operator
import os
import random
import re
import secrets
import signal
import smtplib
import socket
import sqlite3
import ssl
import sys
import tempfile
import threading
import time
import urllib.parse

import bottle

log = logging.getLogger("campaignapi")

#: Configuration accepted by create_app(db, **config), with its defaults.
DEFAULT_CONFIG = {
    # Largest request body accepted, in bytes; larger ones get 413 unread.
    "max_body": 64 * 1024 * 1024,
    # Base URL of the API as the outside world sees it, for links in emails
    # (download, unsubscribe). Empty: taken from the request that causes them.
    "public_url": "",
    # Secret for signed tokens; empty: generated once and kept in the database.
    "secret": "",
    # Seconds a verified API key is remembered by the app, saving a query per
    # request.  A key revoked in this process stops at once; one revoked from
    # another process (the CLI) stops within this time.  0: always ask.
    "key_cache_seconds": 1.0,
}

SCHEMA_VERSION = 1
LEVELS = ("read", "write", "create", "delete")
FIELD_TYPES = ("text", "integer", "number", "boolean", "date", "datetime", "email")
PAGE_DEFAULT, PAGE_MAX = 100, 1000
MAX_ID = 2**63 - 1


# ---------------------------------------------------------------------------
# Errors: handlers raise these; _error_response() turns them into envelopes.
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


# ---------------------------------------------------------------------------
# Database: one connect(), one transaction() helper, the schema.
# ---------------------------------------------------------------------------

PRAGMAS = (
    ("journal_mode", "WAL"),       # readers never wait for the writer
    ("synchronous", "NORMAL"),     # durable at checkpoints; safe with WAL
    ("foreign_keys", "ON"),
    ("busy_timeout", "30000"),     # writers queue instead of failing 'locked'
)


def connect(path):
    """Open a connection to the database at ``path`` with the project's pragmas.

    :param path: the SQLite file.
    """
    conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    try:
        conn.row_factory = sqlite3.Row
        for name, value in PRAGMAS:
            conn.execute(f"PRAGMA {name} = {value}")
    except BaseException:
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def transaction(conn):
    """Run the block as one transaction (a savepoint when already in one).

    ``BEGIN IMMEDIATE`` takes the write lock up front, so two writers queue on
    busy_timeout instead of failing halfway with 'database is locked'.
    """
    if conn.in_transaction:
        name = "sp_" + secrets.token_hex(4)
        conn.execute(f"SAVEPOINT {name}")
        try:
            yield conn
        except BaseException:
            conn.execute(f"ROLLBACK TO {name}")
            conn.execute(f"RELEASE {name}")
            raise
        conn.execute(f"RELEASE {name}")
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


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


def init_db(path):
    """Apply the schema to the database at ``path`` unless it is current.

    An existing database keeps its data: every statement of schema.sql is
    ``IF NOT EXISTS``.  A database made by a newer version is refused.
    """
    conn = connect(path)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{path} has schema version {version}; this campaignapi knows {SCHEMA_VERSION}")
        if version < SCHEMA_VERSION:
            with open(_schema_path(), encoding="utf-8") as f:
                script = f.read()
            conn.executescript(f"BEGIN IMMEDIATE;\n{script}\n"
                               f"PRAGMA user_version = {SCHEMA_VERSION};\nCOMMIT;")
    finally:
        conn.close()


def _now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _str(value):
    """A stored value as the contract answers it: a string, or null."""
    return None if value is None else str(value)


# ---------------------------------------------------------------------------
# Auth: accounts and API keys.  Plain functions; the pipeline calls them.
# ---------------------------------------------------------------------------

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


def issue_key(conn, account, levels=LEVELS, name="", expires=None):
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
            _, secret = issue_key(conn, _account_for(conn, email), levels, name, expires)
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


def authenticate(conn, header):
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


def require_level(key, level):
    """Refuse with 403 unless ``key`` holds ``level``."""
    if level not in key["levels"].split(","):
        raise InsufficientAccess(f"This operation needs an API key with the '{level}' level.")


# ---------------------------------------------------------------------------
# Request plumbing: parameters, identifiers, the envelope.
# ---------------------------------------------------------------------------

# An address: a local part of dot-separated atoms (no leading, trailing or
# double dot; at most 64 characters), '@', a domain of at least two
# alphanumeric labels.  One regex, as it runs on every row of an import.
_EMAIL_ATOM = r"[^@\s\x00-\x1f\x7f<>()\[\],;:\"\\.]+"
_EMAIL_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_EMAIL_RE = re.compile(rf"(?=[^@]{{1,64}}@)({_EMAIL_ATOM}(?:\.{_EMAIL_ATOM})*)"
                       rf"@({_EMAIL_LABEL}(?:\.{_EMAIL_LABEL})+)")


def _normalize_email(value):
    """The address trimmed with its domain lower-cased, or None if invalid."""
    if not isinstance(value, str):
        return None
    value = value.strip()
    match = _EMAIL_RE.fullmatch(value) if len(value) <= 254 else None
    return f"{match[1]}@{match[2].lower()}" if match else None


def _as_int(value):
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value <= MAX_ID else None
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19:
        number = int(value)
        return number if number <= MAX_ID else None
    return None


def _check_str(name, value, multiline):
    if not isinstance(value, str):
        raise InvalidParameter(f"'{name}' must be a string.", field=name)
    if "\x00" in value:
        raise InvalidParameter(f"'{name}' must not contain NUL characters.", field=name)
    if not multiline and ("\r" in value or "\n" in value):
        raise InvalidParameter(f"'{name}' must not contain line breaks.", field=name)
    return value


def _check_int(name, value):
    number = _as_int(value)
    if number is None:
        raise InvalidParameter(f"'{name}' must be a whole number from 0 to {MAX_ID}.", field=name)
    return number


def _check_flag(name, value):
    if value in ("1", 1, "true") or value is True:
        return 1
    if value in ("0", 0, "false") or value is False:
        return 0
    raise InvalidParameter(f"'{name}' must be '0' or '1'.", field=name, allowed=["0", "1"])


def _check_email(name, value):
    value = _check_str(name, value, False)
    if value.strip() == "":
        return ""
    address = _normalize_email(value)
    if address is None:
        raise InvalidParameter(f"'{name}' is not a valid email address.", field=name)
    return address


def _check_list(name, value):
    if not isinstance(value, list):
        raise InvalidParameter(f"'{name}' must be a JSON array.", field=name)
    return value


def _check_scalar(name, value):
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise InvalidParameter(f"'{name}' must be a string or a number.", field=name)
    if isinstance(value, str):
        _check_str(name, value, False)
    return value


def _check_data(name, value):
    # An upload: text (csv, base64) or, for json uploads, an array of objects
    # (or that array as a JSON string); the importer reads it further and
    # answers 422 for data it cannot read.
    if not isinstance(value, (str, list, dict)):
        raise InvalidParameter(f"'{name}' must be a string or a JSON array.", field=name)
    return value


#: Parameter types of the route table: name -> checker(name, value) -> value.
PARAM_TYPES = {
    "str": lambda name, value: _check_str(name, value, False),
    "text": lambda name, value: _check_str(name, value, True),
    "int": _check_int,
    "flag": _check_flag,
    "email": _check_email,
    "list": _check_list,
    "scalar": _check_scalar,
    "data": _check_data,
}


class Param:
    """One declared parameter of a route: ``name:type`` with ``!`` if required."""

    def __init__(self, spec):
        spec, self.required = (spec[:-1], True) if spec.endswith("!") else (spec, False)
        self.name, _, self.type = spec.partition(":")
        self.type = self.type or "str"
        if "|" in self.type:  # a choice: one of the listed strings
            self.choices = self.type.split("|")
        else:
            self.choices = None
            if self.type not in PARAM_TYPES:
                raise ValueError(f"unknown parameter type in {spec!r}")

    def check(self, value):
        if self.choices is not None:
            if value not in self.choices:
                raise InvalidParameter(
                    f"'{self.name}' must be one of: {', '.join(self.choices)}.",
                    field=self.name, allowed=self.choices)
            return value
        return PARAM_TYPES[self.type](self.name, value)


class Route:
    """One row of the route table.

    ``path`` holds placeholders ``{name}`` (an integer id) or ``{name:sel|sel}``
    listing what the placeholder accepts: ``int``, ``all``, ``import``, or
    ``name`` (any single path segment, e.g. a field name).

    ``summary`` titles the operation in the OpenAPI document; ``answers``
    describes its success data there: a record kind's name, a JSON schema of
    ``data``, or a whole OpenAPI response object (with ``content``) for a
    route that answers something other than the envelope.

    ``reads_body=False``: the route takes no parameters from the body and
    ignores whatever body comes (an HTML form post, an RFC 8058 one-click
    unsubscribe), instead of answering 415 for a body that is not JSON.
    """

    _PLACEHOLDER = re.compile(r"\{(\w+)(?::([\w|]+))?\}")

    def __init__(self, method, path, level, handler, params="", writes=None, summary=None,
                 answers=None, reads_body=True):
        self.method, self.path, self.level, self.handler = method, path, level, handler
        # For the OpenAPI document only: a one-line title, and what ``data``
        # holds on success (see openapi_document()).
        self.summary, self.answers = summary, answers
        self.params = {p.name: p for p in map(Param, params.split())}
        self.writes = method != "GET" if writes is None else writes
        self.reads_body = reads_body
        self.ids = {m.group(1): (m.group(2) or "int").split("|")
                    for m in self._PLACEHOLDER.finditer(path)}
        self.rule = "/v1" + self._PLACEHOLDER.sub(r"<\1>", path)
        # What bottle's <name> matches, for telling 405 from 404 ourselves.
        self.pattern = re.compile(re.sub(r"\\\{.*?\\\}", "[^/]+", re.escape("/v1" + path)))

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
            else:
                words = [w for w in allowed if w != "int"]
                allowed_text = "an integer" + "".join(f" or '{w}'" for w in words)
                raise InvalidIdentifier(
                    f"The identifier '{value}' is not valid here: {name} must be {allowed_text}.",
                    field=name)
        return ids


class Call:
    """What a handler gets: the connection, the caller's account, the
    parameters given (already checked), and the app's settings."""

    __slots__ = ("conn", "account", "params", "service", "response_id")

    def __init__(self, conn, account, params, service, response_id):
        self.conn, self.account, self.params = conn, account, params
        self.service, self.response_id = service, response_id

    def get(self, name, default=None):
        return self.params.get(name, default)

    @property
    def base_url(self):
        """Where this API is reachable from outside: for links in emails."""
        if self.service.config["public_url"]:
            return self.service.config["public_url"].rstrip("/")
        request = bottle.request
        prefix = self.service.app.config.get("_mount.prefix", "") or ""
        scheme, netloc = request.urlparts[:2]
        root = (request.script_name.rstrip("/") + "/" + prefix.strip("/")).rstrip("/")
        return f"{scheme}://{netloc}{root}"


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


def _read_params(route, environ, limit):
    """Parameters from the query string and the JSON body (body keys win)."""
    given = {}
    try:
        pairs = urllib.parse.parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True,
                                       encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise InvalidParameter("The query string is not valid UTF-8.") from None
    for name, value in pairs:
        if name in given:
            raise InvalidParameter(f"The parameter '{name}' is given twice.", field=name)
        given[name] = value
    body = _read_body(environ, limit) if route.reads_body else b""
    if body.strip():
        content_type = environ.get("CONTENT_TYPE", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            raise UnsupportedMediaType("Send parameters as JSON with Content-Type: application/json.")
        try:
            # Decoded here, strictly: json.loads(bytes) would pass encoded
            # surrogates (b"\xed\xa0\x80") through as lone surrogates.
            document = json.loads(body.decode("utf-8-sig"))
        except (ValueError, RecursionError):
            raise InvalidJson("The request body is not valid JSON (UTF-8).") from None
        if _SURROGATE_ESCAPE.search(body):
            # A \uD800-\uDFFF escape that is not half of a pair decodes to a
            # lone surrogate, which SQLite and UTF-8 output cannot hold.
            try:
                json.dumps(document, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidJson("The request body holds a \\u escape that is not a valid "
                                  "character (a lone surrogate).") from None
        del body
        if not isinstance(document, dict):
            raise InvalidJson("The request body must be a JSON object of parameters.")
        given.update(document)
    unknown = sorted(set(given) - set(route.params))
    if unknown:
        raise UnknownParameter(
            f"Unknown parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}.",
            field=unknown, allowed=sorted(route.params))
    params = {name: route.params[name].check(value) for name, value in given.items()}
    missing = [p.name for p in route.params.values() if p.required and p.name not in params]
    if missing:
        raise MissingParameter(f"Missing required parameter: {', '.join(missing)}.",
                               field=missing)
    return params


def _page(call):
    """``(limit, offset)`` of a listing, checked."""
    limit = call.get("limit", PAGE_DEFAULT)
    offset = call.get("offset", 0)
    if not 1 <= limit <= PAGE_MAX:
        raise InvalidParameter(f"'limit' must be from 1 to {PAGE_MAX}.", field="limit")
    return limit, offset


def _listing(kind, records, total, limit, offset):
    return {kind: records, "total": str(total), "limit": str(limit), "offset": str(offset)}


def _same_id(call, name, value):
    """Refuse when the body's ``name`` does not repeat the path's id."""
    if call.get(name) != value:
        raise InvalidParameter(f"'{name}' must equal the id in the path ({value}).", field=name)


#: Compact JSON as every answer and stored JSON text is written: one encoder,
#: made once (json.dumps with options builds a new one per call).
_to_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _envelope(response_id, success, data):
    return {"responseId": response_id, "version": 1, "success": success, "data": data}


def _prefers_html(accept):
    """True when the Accept header ranks text/html above JSON (a browser)."""
    if "html" not in (accept or ""):  # API clients: no parsing per request
        return False
    quality = {}
    for item in (accept or "").split(","):
        media, *options = [part.strip() for part in item.split(";")]
        q = 1.0
        for option in options:
            if option.startswith("q="):
                try:
                    q = float(option[2:])
                except ValueError:
                    q = 0.0
        quality[media.lower()] = max(q, quality.get(media.lower(), 0.0))
    html_q = quality.get("text/html", 0.0)
    json_q = max(quality.get("application/json", 0.0), quality.get("application/*", 0.0),
                 quality.get("*/*", 0.0))
    return html_q > json_q


_HTML_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>campaignapi: {title}</title>
<style>body{{font:15px/1.4 system-ui,sans-serif;margin:2em;color:#222}}
pre{{background:#f6f8fa;padding:1em;border-radius:6px;overflow:auto}}
.false{{color:#b00020}}.true{{color:#137333}}</style></head>
<body><h1 class="{success}">{title}</h1><pre id="envelope">{body}</pre></body></html>
"""


def _respond(status, envelope, headers=None):
    """Answer an envelope: JSON, or a small page for a browser.

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
        response.content_type = "text/html; charset=utf-8"
        return _HTML_PAGE.format(
            title=html.escape(title), success=str(envelope["success"]).lower(),
            body=html.escape(json.dumps(envelope, indent=2, ensure_ascii=False)))
    response.content_type = "application/json"
    return _to_json(envelope)


def _error_response(response_id, error):
    """The one place an error becomes an envelope."""
    return _respond(error.status, _envelope(response_id, False, error.data()), error.headers)


def _request_header(name):
    """A request header as the server gave it (latin-1 text).  Not bottle's
    get_header(), which re-decodes it as UTF-8 and raises on other bytes."""
    return bottle.request.environ.get("HTTP_" + name.upper().replace("-", "_"), "")


def _check_path(environ):
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


_response_ids = random.Random(os.urandom(32))


def _new_response_id():
    # Unique, not secret: a seeded generator instead of os.urandom per request,
    # whose system call hands the GIL to another thread and waits to get it back.
    return f"{_response_ids.getrandbits(128):032x}"


class Service:
    """The state of one app: its database, settings and per-thread connections."""

    def __init__(self, db, config):
        self.db, self.config = db, config
        self.app = None
        self.routes = ()  # the Route rows this app serves
        self._local = threading.local()
        self._secret = None
        self._keys = {}  # Authorization header -> (key row, remembered until, epoch)

    def key(self, conn, header):
        """authenticate(), remembering a verified key for key_cache_seconds."""
        remembered = self._keys.get(header)
        if remembered is not None:
            key, until, epoch = remembered
            if until > time.monotonic() and epoch == _key_epoch \
                    and not (key["expires"] and key["expires"] < _now()):
                return key
        key = authenticate(conn, header)
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

    def dispatch(self, route, raw_ids):
        """The request pipeline: every route goes through here."""
        response_id = _new_response_id()
        request = bottle.request
        started = time.perf_counter()
        status = 500
        try:
            _check_path(request.environ)
            conn = self.conn()
            account = None
            if route.level:
                key = self.key(conn, _request_header("Authorization"))
                require_level(key, route.level)
                account = key["account"]
            ids = route.parse_ids(raw_ids)
            params = _read_params(route, request.environ, self.config["max_body"])
            call = Call(conn, account, params, self, response_id)
            if route.writes:
                with transaction(conn):
                    data = route.handler(call, **ids)
            else:
                data = route.handler(call, **ids)
            if isinstance(data, bottle.HTTPResponse):  # a download or a page
                data.set_header("X-Response-Id", response_id)
                status = data.status_code
                return data
            status = 200
            return _respond(200, _envelope(response_id, True, data))
        except ApiError as error:
            status = error.status
            return _error_response(response_id, error)
        except sqlite3.IntegrityError:
            status = 409
            return _error_response(response_id, Conflict(
                "The change conflicts with existing data (a duplicate or a missing reference)."))
        except Exception:
            log.exception("internal error, responseId %s", response_id)
            return _error_response(response_id, ApiError(
                f"Something went wrong on our side; quote responseId {response_id} when reporting it."))
        finally:
            if log.isEnabledFor(logging.INFO):  # the arguments cost, even unlogged
                log.info("%s %s %s %s %.1fms", response_id, request.method,
                         _loggable_path(request.path, raw_ids), status,
                         (time.perf_counter() - started) * 1000)

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
        error = MethodNotAllowed(f"{request.method} is not allowed here; allowed: "
                                 f"{', '.join(allowed)}.", allowed=allowed)
        error.headers = {"Allow": ", ".join(allowed)}
        return error

    def no_route(self, path=""):
        """The catch-all route: our envelope even where bottle's error handler
        is not ours (Bottle.mount merges these routes into the parent app)."""
        response_id = _new_response_id()
        error = self.unrouted()
        log.info("%s %s %s %s", response_id, bottle.request.method, bottle.request.path,
                 error.status)
        return _error_response(response_id, error)

    def bottle_error(self, error):
        """Bottle's own errors as envelopes."""
        response_id = _new_response_id()
        if error.status_code in (404, 405):
            api_error = self.unrouted()
        elif error.status_code == 413:
            api_error = PayloadTooLarge("The request body is too large.")
        elif error.status_code >= 500:
            log.error("internal error, responseId %s: %s", response_id, error.traceback or error.body)
            api_error = ApiError(f"Something went wrong on our side; quote responseId {response_id}.")
        else:
            api_error = InvalidParameter(str(error.body))
            api_error.status = error.status_code
        log.info("%s %s %s %s", response_id, bottle.request.method, bottle.request.path,
                 api_error.status)
        # Bottle already copied the error's status and headers into the
        # response it will send; _respond() sets ours over them.
        return _error_response(response_id, api_error)


def _stored_secret(conn):
    row = conn.execute("SELECT value FROM setting WHERE name = 'secret'").fetchone()
    if row:
        return row["value"]
    with transaction(conn):
        conn.execute("INSERT OR IGNORE INTO setting (name, value) VALUES ('secret', ?)",
                     (secrets.token_hex(32),))
    return conn.execute("SELECT value FROM setting WHERE name = 'secret'").fetchone()["value"]


# ---------------------------------------------------------------------------
# Records: the shared plumbing of every resource that has an owner.
# ---------------------------------------------------------------------------

class Kind:
    """A kind of owned record: its table, its answer key, its record shape.

    ``columns`` is what a lookup selects (derived columns ride along in the
    same statement: every statement costs a GIL round trip under load).
    """

    def __init__(self, name, table, shape, soft_delete=True, label=None, columns="*"):
        self.name, self.table, self.shape = name, table, shape
        self.soft_delete = soft_delete
        self.label = label or name
        self.columns = columns


def get_owned(conn, kind, account, record_id, *, live=False):
    """The row ``record_id`` of ``kind`` if ``account`` owns it, else 404.

    :param live: also refuse (409) a soft-deleted record, for writes and uses.
    """
    row = conn.execute(f"SELECT {kind.columns} FROM {kind.table} WHERE id = ? AND owner = ?",
                       (record_id, account)).fetchone()
    if row is None:
        raise NotFound(f"There is no {kind.label} {record_id}.")
    if live and kind.soft_delete and row["deleted"]:
        raise Conflict(f"{kind.label.capitalize()} {record_id} is deleted.")
    return row


def list_owned(call, kind, where="", args=()):
    """One page of the account's records of ``kind`` that are not deleted.

    :param where: a further SQL condition (a fixed string, never request text).
    """
    where = " AND ".join(filter(None, ["owner = ?", "deleted = 0" if kind.soft_delete else "",
                                        where]))
    return list_page(call, kind, where, (call.account, *args))


def list_page(call, kind, where, args, shape=None):
    """One page (by id) of the rows of ``kind`` that match ``where``, shaped:
    ``(records, total, limit, offset)``.  ``where`` is a fixed SQL string."""
    limit, offset = _page(call)
    shape = shape or kind.shape
    total = call.conn.execute(f"SELECT count(*) FROM {kind.table} WHERE {where}",
                              args).fetchone()[0]
    rows = call.conn.execute(f"SELECT {kind.columns} FROM {kind.table} WHERE {where} ORDER BY id "
                             "LIMIT ? OFFSET ?", (*args, limit, offset)).fetchall()
    return [shape(call.conn, row) for row in rows], total, limit, offset


def get_record(call, kind, record_id):
    """The Get answer for ``record_id``: one record, or a page for ``all``."""
    if record_id == "all":
        return _listing(kind.name, *list_owned(call, kind))
    return {kind.name: kind.shape(call.conn, get_owned(call.conn, kind, call.account, record_id))}


def insert_record(conn, table, record_id, values):
    """Insert a row at ``record_id`` (0: the next id) and return its id.

    A positive free id is taken as given, so a client can retry a create.
    """
    if record_id:
        if conn.execute(f"SELECT 1 FROM {table} WHERE id = ?", (record_id,)).fetchone():
            raise Conflict(f"The id {record_id} is taken; create at id 0 to get a new one.")
        values = {"id": record_id, **values}
    columns = ", ".join(values)
    marks = ", ".join("?" for _ in values)
    return conn.execute(f"INSERT INTO {table} ({columns}) VALUES ({marks})",
                        tuple(values.values())).lastrowid


def update_record(conn, table, record_id, values):
    """Set ``values`` (column -> value) on row ``record_id``; nothing if empty."""
    if values:
        assignments = ", ".join(f"{column} = ?" for column in values)
        conn.execute(f"UPDATE {table} SET {assignments} WHERE id = ?",
                     (*values.values(), record_id))


def soft_delete(call, kind, record_id):
    get_owned(call.conn, kind, call.account, record_id, live=True)
    call.conn.execute(f"UPDATE {kind.table} SET deleted = 1 WHERE id = ?", (record_id,))
    return True


def _columns(call, names):
    """The given parameters among ``names``, as column -> value."""
    return {name: call.params[name] for name in names if name in call.params}


class Resource(Kind):
    """A Kind whose four operations are the standard ones, as route handlers.

    ``values(call, row)`` turns the checked parameters into columns (``row`` is
    the stored record on change, None on create) and refuses what does not fit.
    """

    def __init__(self, name, table, shape, values, **options):
        super().__init__(name, table, shape, **options)
        self.values = values

    def get(self, call, id):
        return get_record(call, self, id)

    def create(self, call, id):
        values = {"owner": call.account, "created": _now(), **self.values(call, None)}
        return {"id": str(insert_record(call.conn, self.table, id, values))}

    def change(self, call, id):
        row = get_owned(call.conn, self, call.account, id, live=True)
        update_record(call.conn, self.table, id, self.values(call, row))
        return True

    def delete(self, call, id):
        if "id" in call.params:  # optional here, but must match when given
            _same_id(call, "id", id)
        return soft_delete(call, self, id)


# ---------------------------------------------------------------------------
# Datasources
# ---------------------------------------------------------------------------

def _datasource_record(conn, row):
    fields = [{"id": str(f["id"]), "name": f["name"], "type": f["type"]} for f in conn.execute(
        "SELECT id, name, type FROM field WHERE datasource = ? ORDER BY id", (row["id"],))]
    recipients = conn.execute("SELECT count(*) FROM recipient WHERE datasource = ? "
                              "AND status = 'active'", (row["id"],)).fetchone()[0]
    return {"id": str(row["id"]), "owner": str(row["owner"]), "name": row["name"],
            "description": row["description"], "origin": row["origin"], "fields": fields,
            "recipients": str(recipients), "created": row["created"],
            "deleted": str(row["deleted"])}


DATASOURCE = Kind("datasource", "datasource", _datasource_record)


def _checked_fields(fields):
    """A create/change ``fields`` list as ``[(name, type)]``, refusing bad ones."""
    checked = {}
    for index, item in enumerate(fields):
        if not isinstance(item, dict) or set(item) - {"name", "type"} or "name" not in item:
            raise InvalidParameter(f"fields[{index}] must be an object with 'name' and 'type'.",
                                   field="fields")
        name = item["name"]
        kind = item.get("type", "text")
        if not valid_field_name(name):
            raise InvalidParameter(f"fields[{index}].name must be a non-empty single-line name "
                                   "without braces.", field="fields")
        if kind not in FIELD_TYPES:
            raise InvalidParameter(f"fields[{index}].type must be one of {', '.join(FIELD_TYPES)}.",
                                   field="fields", allowed=list(FIELD_TYPES))
        name = name.strip()
        if name.lower() == "email" and kind != "email":
            raise InvalidParameter("The field 'email' always exists, with type email.",
                                   field="fields")
        checked[name.lower()] = (name, kind)
    return list(checked.values())


def valid_field_name(name):
    """A field name is one non-empty line without braces (they mark merge tags)."""
    return isinstance(name, str) and bool(name.strip()) and len(name) <= 200 \
        and not any(c in name for c in "\r\n\x00{}")


def _add_fields(conn, datasource, fields):
    """Add the fields that the datasource lacks; a known name must keep its type."""
    existing = {row["name"].lower(): row["type"] for row in conn.execute(
        "SELECT name, type FROM field WHERE datasource = ?", (datasource,))}
    for name, kind in fields:
        if name.lower() not in existing:
            conn.execute("INSERT INTO field (datasource, name, type) VALUES (?, ?, ?)",
                         (datasource, name, kind))
            existing[name.lower()] = kind  # create lists 'email' itself and may repeat it
        elif existing[name.lower()] != kind:
            raise Conflict(f"The field '{name}' exists with type {existing[name.lower()]}; "
                           "change its type with the modify operation.", field="fields")


def datasource_get(call, id):
    if id == "import":
        return _listing("datasource", *list_owned(call, DATASOURCE, "origin = 'import'"))
    return get_record(call, DATASOURCE, id)


def datasource_create(call, id):
    fields = _checked_fields(call.get("fields", []))
    values = {"owner": call.account, "created": _now(), "name": call.get("name"),
              **_columns(call, ("description", "origin"))}
    new_id = insert_record(call.conn, "datasource", id, values)
    _add_fields(call.conn, new_id, [("email", "email")] + fields)
    return {"id": str(new_id)}


def datasource_change(call, id):
    get_owned(call.conn, DATASOURCE, call.account, id, live=True)
    update_record(call.conn, "datasource", id, _columns(call, ("name", "description", "origin")))
    if "fields" in call.params:
        _add_fields(call.conn, id, _checked_fields(call.params["fields"]))
    return True


def datasource_delete(call, id):
    _same_id(call, "id", id)
    return soft_delete(call, DATASOURCE, id)


_DATETIME_FORMATS = ("%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M")
_TRUE, _FALSE = {"1", "true", "yes", "y", "t", "on"}, {"0", "false", "no", "n", "f", "off"}


def convert_value(kind, value):
    """A field value as stored for a field of type ``kind`` (ValueError if it
    cannot be).  Empty stays None, so a blank cell never fails a type."""
    if value is None:
        return None
    if isinstance(value, bool):
        value = "1" if value else "0"
    text = str(value).strip()
    if text == "":
        return None
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


def display_value(value):
    """A stored field value as the API answers it (and merge tags insert it)."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def datasource_fields(conn, datasource):
    """``{lower-case name: (field id, name, type)}`` of one datasource."""
    return {row["name"].lower(): (row["id"], row["name"], row["type"]) for row in conn.execute(
        "SELECT id, name, type FROM field WHERE datasource = ?", (datasource,))}


def recipient_values(fields, row):
    """``{field name: display string}`` of a recipient row, email included.

    :param fields: the datasource's fields, as datasource_fields() gives them.
    """
    data = json.loads(row["data"])
    values = {name: display_value(data.get(str(field_id)))
              for field_id, name, _ in fields.values()}
    values["email"] = row["email"]
    return values


# ---------------------------------------------------------------------------
# Recipients, field changes, imports, exports, organize
# ---------------------------------------------------------------------------

#: Rows read, checked and written per executemany (imports, retypes).
CHUNK_ROWS = 5000
#: How many failing rows an import record or a 422 answer lists.
ROWS_REPORTED = 100
#: How long an export's download link works.
EXPORT_LIFETIME = datetime.timedelta(days=7)
#: Header names of the email column, compared without case, spaces, '-' or '_'.
_EMAIL_COLUMNS = {"email", "emailaddress"}
_ASCII_FOLD = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def get_datasource(conn, account, datasource_id, *, live=False):
    """The caller's datasource row, else 404 (409 if deleted and ``live``)."""
    return get_owned(conn, DATASOURCE, account, datasource_id, live=live)


def _get_child(call, kind, parent_id, child_id, *, live=False, parent="datasource"):
    """Row ``child_id`` of ``kind`` that belongs to the caller's datasource
    ``parent_id`` (the column ``parent`` names it), else 404."""
    get_datasource(call.conn, call.account, parent_id, live=live)
    row = call.conn.execute(f"SELECT * FROM {kind.table} WHERE id = ? AND {parent} = ?",
                            (child_id, parent_id)).fetchone()
    if row is None:
        raise NotFound(f"There is no {kind.label} {child_id} in datasource {parent_id}.")
    return row


def _child_get(call, kind, parent_id, child_id, *, parent="datasource", shape=None):
    """The Get answer of a datasource's sub-resource: one record or a page."""
    shape = shape or kind.shape
    if child_id == "all":
        get_datasource(call.conn, call.account, parent_id)
        return _listing(kind.name, *list_page(call, kind, f"{parent} = ?", (parent_id,), shape))
    return {kind.name: shape(call.conn, _get_child(call, kind, parent_id, child_id,
                                                    parent=parent))}


def _nocase(address):
    """An address as the recipient table compares it (SQLite NOCASE folds ASCII only)."""
    return address.lower() if address.isascii() else address.translate(_ASCII_FOLD)


# Recipients -----------------------------------------------------------------

def _recipient_record(fields, row):
    data = json.loads(row["data"])
    values = {}
    for field_id, name, _ in fields.values():
        value = data.get(str(field_id))
        values[name] = None if value is None else display_value(value)
    values["email"] = row["email"]
    return {"id": str(row["id"]), "datasource": str(row["datasource"]), "email": row["email"],
            "fields": values, "status": row["status"], "created": row["created"],
            "updated": row["updated"]}


RECIPIENT = Kind("recipient", "recipient", None, soft_delete=False)  # shaped with its fields


def recipient_get(call, parent_id, child_id):
    get_datasource(call.conn, call.account, parent_id)
    fields = datasource_fields(call.conn, parent_id)
    shape = lambda conn, row: _recipient_record(fields, row)  # noqa: E731 - fields read once
    if child_id != "all":
        return {"recipient": shape(call.conn, _get_child(call, RECIPIENT, parent_id, child_id))}
    where, args = "datasource = ?", (parent_id,)
    if "status" in call.params:
        where, args = where + " AND status = ?", (*args, call.params["status"])
    return _listing("recipient", *list_page(call, RECIPIENT, where, args, shape))


# Field changes --------------------------------------------------------------

def _field_record(conn, row):
    return {"id": str(row["id"]), "datasource": str(row["datasource"]), "name": row["name"],
            "type": row["type"]}


def _find_field(conn, datasource, ref):
    """A datasource's field by id or by name (without case), else 404."""
    row = None
    if ref.isascii() and ref.isdigit():
        row = conn.execute("SELECT * FROM field WHERE id = ? AND datasource = ?",
                           (_as_int(ref), datasource)).fetchone()
    if row is None:
        row = conn.execute("SELECT * FROM field WHERE name = ? AND datasource = ?",
                           (ref, datasource)).fetchone()
    if row is None:
        raise NotFound(f"Datasource {datasource} has no field '{ref}'.")
    return row


def field_modify(call, parent_id, child_id):
    """Rename a field and/or change its type (the spec's GET modify)."""
    get_datasource(call.conn, call.account, parent_id, live=True)
    field = _find_field(call.conn, parent_id, child_id)
    name, kind = call.params["new"].strip(), call.params["type"]
    if field["name"].lower() == "email" and (name.lower() != "email" or kind != "email"):
        raise Conflict("The email field cannot be renamed or retyped.", field="new")
    if not valid_field_name(name):
        raise InvalidParameter("'new' must be a non-empty single-line name without braces, "
                               "at most 200 characters.", field="new")
    taken = call.conn.execute("SELECT 1 FROM field WHERE datasource = ? AND name = ? AND id != ?",
                              (parent_id, name, field["id"])).fetchone()
    if taken:
        raise Conflict(f"Datasource {parent_id} already has a field named '{name}'.", field="new")
    if kind != field["type"]:
        _retype(call.conn, parent_id, field, kind)
    update_record(call.conn, "field", field["id"], {"name": name, "type": kind})
    return {"field": _field_record(call.conn, _find_field(call.conn, parent_id, str(field["id"])))}


def _retype(conn, datasource, field, kind):
    """Convert every stored value of ``field`` to ``kind``, chunk by chunk.

    On the first failure writing stops; the scan goes on to name up to
    ROWS_REPORTED failing rows, then InvalidData rolls the request back, so
    the data stays as it was.
    """
    path = f'$."{int(field["id"])}"'
    failures, last_id = [], 0
    while len(failures) < ROWS_REPORTED:
        rows = conn.execute(
            "SELECT id, email, json_extract(data, ?1) AS value FROM recipient "
            "WHERE datasource = ?2 AND id > ?3 AND json_extract(data, ?1) IS NOT NULL "
            "ORDER BY id LIMIT ?4", (path, datasource, last_id, CHUNK_ROWS)).fetchall()
        if not rows:
            break
        last_id = rows[-1]["id"]
        updates = []
        for row in rows:
            try:
                updates.append((path, convert_value(kind, display_value(row["value"])), row["id"]))
            except ValueError as error:
                failures.append({"recipient": str(row["id"]), "email": row["email"],
                                 "value": display_value(row["value"]), "error": str(error)})
                if len(failures) >= ROWS_REPORTED:
                    break
        if not failures:
            conn.executemany("UPDATE recipient SET data = json_set(data, ?, ?) WHERE id = ?",
                             updates)
    if failures:
        raise InvalidData(f"The field '{field['name']}' cannot become {kind}: some stored values "
                          "do not convert (the first are listed); nothing was changed.",
                          rows=failures)


# Imports --------------------------------------------------------------------

def _import_record(conn, row):
    return {"id": str(row["id"]), "datasource": str(row["datasource"]), "name": row["name"],
            "originalfile": row["originalfile"], "uploadtype": row["uploadtype"],
            "status": row["status"], "rows": str(row["rows"]), "inserted": str(row["inserted"]),
            "updated": str(row["updated"]), "skipped": str(row["skipped"]),
            "errors": json.loads(row["errors"]), "created": row["created"],
            "finished": row["finished"]}


IMPORT = Kind("import", "import", _import_record, soft_delete=False)

class _Importer:
    """Typed rows in, recipients out: checks each row, keeps the chunk being
    built, writes it in one statement per chunk and keeps the figures."""

    def __init__(self, conn, datasource, import_id):
        self.conn, self.datasource, self.import_id = conn, datasource, import_id
        self.fields = datasource_fields(conn, datasource)
        self.names = {}                   # field key -> name, for messages
        self.pending = {}                 # folded address -> (address, keys, values)
        self.rows = self.inserted = self.updated = self.skipped = 0
        self.errors = []
        # Existing recipients this import already updated: a repeated row
        # in a later chunk must not count again.
        conn.execute("CREATE TEMP TABLE IF NOT EXISTS import_touched (id INTEGER PRIMARY KEY)")
        conn.execute("DELETE FROM temp.import_touched")

    def report(self, number, error):
        if len(self.errors) < ROWS_REPORTED:
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
            if not valid_field_name(label):
                self.report(1, f"column '{label[:50]}' left out: a field name is one line "
                               "without braces, at most 200 characters")
                return None
            field_id = self.conn.execute(
                "INSERT INTO field (datasource, name, type) VALUES (?, ?, 'text')",
                (self.datasource, label)).lastrowid
            field = self.fields[label.lower()] = (field_id, label, "text")
        self.names[str(field[0])] = field[1]
        return str(field[0]), field[2]

    def convert(self, number, keys, kinds, raws):
        """The raw values typed for their fields, or None (the row is skipped)."""
        try:
            return tuple([convert_value(kind, raw) for kind, raw in zip(kinds, raws)])
        except ValueError:
            pass
        for key, kind, raw in zip(keys, kinds, raws):  # only for the message
            try:
                convert_value(kind, raw)
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
        folded = _nocase(address)
        earlier = self.pending.get(folded)
        if earlier is not None and earlier[1] != keys:  # a repeat with other fields: merge
            merged = {**dict(zip(earlier[1], earlier[2])), **dict(zip(keys, values))}
            keys, values = tuple(merged), tuple(merged.values())
        self.pending[folded] = (address, keys, values)
        if len(self.pending) >= CHUNK_ROWS:
            self.flush()

    def flush(self):
        """Write the chunk: new addresses inserted, known ones updated (their
        values merged in, never their status), each counted once."""
        pending, self.pending = self.pending, {}
        if not pending:
            return
        known, touched = {}, []
        for recipient_id, email, source, seen in self.conn.execute(
                "SELECT r.id, r.email, r.import, t.id IS NOT NULL FROM recipient r "
                "LEFT JOIN temp.import_touched t ON t.id = r.id "
                "WHERE r.datasource = ? AND r.email IN (SELECT value FROM json_each(?))",
                (self.datasource, _to_json([item[0] for item in pending.values()]))):
            known[_nocase(email)] = recipient_id
            if source != self.import_id and not seen:
                touched.append((recipient_id,))
        self.inserted += len(pending) - len(known)
        self.updated += len(touched)
        self.conn.executemany("INSERT INTO temp.import_touched (id) VALUES (?)", touched)
        now, inserts, updates = _now(), [], []
        for folded, (address, keys, values) in pending.items():
            recipient_id = known.get(folded)
            if recipient_id is None:
                inserts.append((self.datasource, address, self.import_id, now,
                                _data_json(keys, values)))
            else:  # blank values remove what the recipient had
                updates.append((now, _data_json(keys, values, blank="null"), recipient_id))
        self.conn.executemany(
            "INSERT INTO recipient (datasource, email, import, created, updated, data) "
            "VALUES (?1, ?2, ?3, ?4, ?4, ?5)", inserts)
        self.conn.executemany(
            "UPDATE recipient SET updated = ?, data = json_patch(data, ?) WHERE id = ?", updates)


_json_string = json.encoder.encode_basestring  # C; keeps non-ASCII as it is, like _to_json


def _data_json(keys, values, *, blank=None):
    """The JSON object text of field values for recipient.data, keyed by the
    field ids ``keys``.  A blank value (None, or only whitespace as
    convert_value() has it) is left out, or written as ``null`` when
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
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        pass
    # Line-wrapped (MIME), URL-safe or unpadded base64; only now worth a copy.
    data = "".join(data.split()).translate(str.maketrans("-_", "+/"))
    try:
        return base64.b64decode(data + "=" * (-len(data) % 4), validate=True)
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


def _import_csv(importer, raw):
    """Read a CSV file lazily, row by row, into the importer."""
    stream = io.TextIOWrapper(io.BytesIO(raw), encoding=_text_encoding(raw), newline="")
    first = stream.readline()
    delimiter = None
    if first.strip().lower().startswith("sep=") and len(first.strip()) == 5:
        delimiter, first = first.strip()[4], stream.readline()  # Excel's "sep=;" line
    reader = csv.reader(itertools.chain([first], stream),
                        delimiter=delimiter or _sniff_delimiter(first))
    header = next(reader, None)
    if not header or not any(cell.strip() for cell in header):
        raise InvalidData("The upload has no header row; nothing was imported.",
                          field="__uploaddata__")
    email_at = next((i for i, name in enumerate(header) if _is_email_column(name)), None)
    if email_at is None:
        raise InvalidData("The upload has no email column (named email, e-mail or "
                          "emailaddress); nothing was imported.", field="__uploaddata__")
    columns = [(i, column) for i, column in ((i, importer.column(name)) for i, name
                                             in enumerate(header) if i != email_at) if column]
    # Text cells go to SQL as they are; only typed ones are converted here.
    text = [(i, key) for i, (key, kind) in columns if kind == "text"]
    typed = [(i, key, kind) for i, (key, kind) in columns if kind != "text"]
    text_cells, typed_cells = _picker([i for i, _ in text]), _picker([i for i, _, _ in typed])
    text_keys = tuple(key for _, key in text)
    typed_keys, kinds = tuple(key for _, key, _ in typed), [kind for _, _, kind in typed]
    keys = text_keys + typed_keys
    width, number = len(header), 1
    while True:
        try:
            for cells in reader:
                number += 1
                if not any(cells):
                    continue  # a blank line
                if len(cells) < width:
                    cells += [""] * (width - len(cells))
                values = text_cells(cells)
                if typed:
                    converted = importer.convert(number, typed_keys, kinds, typed_cells(cells))
                    if converted is None:
                        importer.rows += 1
                        continue
                    values += converted
                importer.add(number, cells[email_at], keys, values)
            return
        except csv.Error as error:
            number += 1
            importer.rows += 1
            importer.skip(number, f"unreadable row: {error}")


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


def import_get(call, parent_id, child_id):
    return _child_get(call, IMPORT, parent_id, child_id)


def import_create(call, parent_id, child_id):
    """Import a CSV file or an array of objects into the datasource, as one
    transaction (the request's), in chunks; mail the figures to the account."""
    datasource = get_datasource(call.conn, call.account, parent_id, live=True)
    upload_type = call.params["__uploadtype__"]
    # Popped, so that once read it is garbage: the upload is the big thing.
    data = call.params.pop("__uploaddata__")
    raw = None if upload_type == "json" else _upload_bytes(upload_type, data)
    if raw is not None:
        data = None
    import_id = insert_record(call.conn, "import", child_id, {
        "datasource": parent_id, "name": call.params["name"],
        "originalfile": call.params["originalfile"], "uploadtype": upload_type,
        "status": "running", "created": _now()})
    importer = _Importer(call.conn, parent_id, import_id)
    try:
        if raw is None:
            _import_json(importer, data)
        else:
            _import_csv(importer, raw)
    except UnicodeDecodeError:
        raise InvalidData("The upload is not readable text (UTF-8, UTF-16 or Latin-1); "
                          "nothing was imported.", field="__uploaddata__") from None
    importer.flush()
    update_record(call.conn, "import", import_id, {
        "status": "finished", "rows": importer.rows, "inserted": importer.inserted,
        "updated": importer.updated, "skipped": importer.skipped,
        "errors": _to_json(importer.errors), "finished": _now()})
    call.conn.execute("DELETE FROM temp.import_touched")
    _notify_import(call, datasource, call.conn.execute("SELECT * FROM import WHERE id = ?",
                                                       (import_id,)).fetchone())
    return {"id": str(import_id)}


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
    enqueue_email(call.conn, call.account, account_email(call.conn, call.account),
                  f'Import "{title}" finished: {row["inserted"]} new, {row["updated"]} updated, '
                  f'{row["skipped"]} skipped', "\n".join(lines) + "\n")


def import_change(call, parent_id, child_id):
    _same_id(call, "id", child_id)
    _get_child(call, IMPORT, parent_id, child_id, live=True)
    update_record(call.conn, "import", child_id, _columns(call, ("name", "originalfile")))
    return True


def import_delete(call, parent_id, child_id):
    """Delete the import record and the recipients that this import inserted."""
    _same_id(call, "id", child_id)
    _get_child(call, IMPORT, parent_id, child_id, live=True)
    call.conn.execute("DELETE FROM recipient WHERE import = ?", (child_id,))
    call.conn.execute("DELETE FROM import WHERE id = ?", (child_id,))
    return True


# Exports --------------------------------------------------------------------

def _export_record(call, row):
    live = row["status"] == "finished" and row["expires"] > _now()
    return {"id": str(row["id"]), "datasource": str(row["datasource"]), "status": row["status"],
            "rows": str(row["rows"]),
            "url": f"{call.base_url}/v1/download/{row['token']}" if live else None,
            "expires": row["expires"], "created": row["created"], "finished": row["finished"]}


EXPORT = Kind("export", "export", None, soft_delete=False)


def export_get(call, parent_id, child_id):
    """Id 0: export the datasource now; a positive id: an earlier export."""
    if child_id == 0:
        return {"export": _export_record(call, _run_export(call, parent_id))}
    return {"export": _export_record(call, _get_child(call, EXPORT, parent_id, child_id))}


def _export_folder(db):
    return os.path.abspath(db) + "-exports"


def _run_export(call, datasource_id):
    """Write the active recipients to a CSV file beside the database.

    Not one transaction on purpose: the file is written from one read
    statement (a consistent snapshot under WAL) without holding the write
    lock, so a long export never blocks imports or sending.  If it fails,
    the record and the file are removed again.
    """
    conn, folder = call.conn, _export_folder(call.service.db)
    with transaction(conn):
        datasource = get_datasource(conn, call.account, datasource_id, live=True)
        _purge_exports(conn)
        expires = (datetime.datetime.now(datetime.timezone.utc) + EXPORT_LIFETIME)
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
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        with transaction(conn):
            conn.execute("DELETE FROM export WHERE id = ?", (export_id,))
        raise
    return row


def _write_export(conn, datasource_id, path):
    """Stream the datasource's active recipients into ``path``; the row count."""
    fields = sorted(field for field in datasource_fields(conn, datasource_id).values()
                    if field[2] != "email")
    # Field ids are integers from our own table, never request text.
    columns = "".join(f", json_extract(data, '$.\"{int(field_id)}\"')" for field_id, _, _ in fields)
    cursor = conn.cursor()
    cursor.row_factory = None
    count = 0
    partial = path + ".part"
    try:
        with open(partial, "w", newline="", encoding="utf-8") as file:
            writer = csv.writer(file)
            writer.writerow(["email"] + [name for _, name, _ in fields])
            for row in cursor.execute(f"SELECT email{columns} FROM recipient WHERE datasource = ? "
                                      "AND status = 'active' ORDER BY id", (datasource_id,)):
                writer.writerow([row[0], *map(display_value, row[1:])])
                count += 1
        os.replace(partial, path)
    finally:
        cursor.close()
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
    enqueue_email(call.conn, call.account, account_email(call.conn, call.account),
                  f'Export of "{datasource["name"]}" is ready', body)


def download(call, token):
    """The CSV of an export, to anyone holding its link, until it expires."""
    row = call.conn.execute("SELECT * FROM export WHERE token = ?", (token,)).fetchone()
    if row is None or row["status"] != "finished" or row["expires"] <= _now() \
            or not row["path"] or not os.path.isfile(row["path"]):
        raise NotFound("This download link is unknown or has expired; start a new export.")
    return bottle.static_file(os.path.basename(row["path"]), root=os.path.dirname(row["path"]),
                              mimetype="text/csv",
                              download=f"datasource-{row['datasource']}-export-{row['id']}.csv")


# Organize -------------------------------------------------------------------

def _organize_record(conn, row):
    return {"id": str(row["id"]), "item": str(row["item"]), "folder": row["folder"],
            "sortorder": str(row["sortorder"])}


ORGANIZE = Kind("organize", "organize", _organize_record, soft_delete=False,
                label="organize record")


def organize_get(call, parent_id, child_id):
    return _child_get(call, ORGANIZE, parent_id, child_id, parent="item")


def organize_create(call, parent_id, child_id):
    get_datasource(call.conn, call.account, parent_id, live=True)
    if call.params["item"] != parent_id:
        raise InvalidParameter(f"'item' must be the datasource in the path ({parent_id}).",
                               field="item")
    existing = call.conn.execute("SELECT id FROM organize WHERE item = ?", (parent_id,)).fetchone()
    if existing:
        raise Conflict(f"Datasource {parent_id} already has organize record {existing['id']}; "
                       "change it with POST.")
    new_id = insert_record(call.conn, "organize", child_id,
                           {"item": parent_id, **_columns(call, ("folder", "sortorder"))})
    return {"id": str(new_id)}


def organize_change(call, parent_id, child_id):
    """Spec rule 4: the datasource ``parent_id`` names the record; ``id`` repeats its id."""
    get_datasource(call.conn, call.account, parent_id, live=True)
    row = call.conn.execute("SELECT id FROM organize WHERE item = ?", (parent_id,)).fetchone()
    if row is None:
        raise NotFound(f"Datasource {parent_id} has no organize record; create one with PUT.")
    if call.params["id"] != row["id"]:
        raise InvalidParameter(f"'id' must be the id of datasource {parent_id}'s organize record "
                               f"({row['id']}).", field="id")
    update_record(call.conn, "organize", row["id"], _columns(call, ("folder", "sortorder")))
    return True


# ---------------------------------------------------------------------------
# Messages and sender profiles
# ---------------------------------------------------------------------------

#: The columns a Create or Change message takes (all optional: verify says
#: what a message still lacks before it can be sent).
_MESSAGE_COLUMNS = ("name", "subject", "fromname", "fromaddress", "replyto", "html", "text")
_PROFILE_COLUMNS = ("name", "fromname", "fromaddress", "replyto")
#: Values that end up in mail headers; the ``str``/``email`` parameter types
#: refuse line breaks, verify checks stored rows once more.
_HEADER_COLUMNS = ("name", "subject", "fromname", "fromaddress", "replyto")


def _plain_record(columns):
    """The record shape of a table whose record is its columns, as strings."""
    def shape(conn, row):
        return {"id": str(row["id"]), "owner": str(row["owner"]),
                **{name: row[name] for name in columns},
                "created": row["created"], "deleted": str(row["deleted"])}
    return shape


MESSAGE = Resource("message", "message", _plain_record(_MESSAGE_COLUMNS),
                   lambda call, row: _columns(call, _MESSAGE_COLUMNS))
ACCOUNTPROFILE = Resource("accountprofile", "accountprofile", _plain_record(_PROFILE_COLUMNS),
                          lambda call, row: _columns(call, _PROFILE_COLUMNS),
                          label="sender profile")


# ---------------------------------------------------------------------------
# Segments
# ---------------------------------------------------------------------------

SEGMENT_OPS = ("eq", "ne", "contains", "startswith", "gt", "lt", "empty", "notempty")


def _condition_sql(column, kind, op, value):
    """SQL for one condition on one column expression, and its parameters.

    ``column`` is SQL we build from field ids, never request text; the value is
    always a parameter, converted to the field's type so comparisons are typed.
    """
    if op == "empty":
        return f"({column} IS NULL OR {column} = '')", ()
    if op == "notempty":
        return f"({column} IS NOT NULL AND {column} != '')", ()
    if op in ("contains", "startswith"):
        needle = str(value).lower()
        if op == "contains":
            return f"instr(lower({column}), ?) > 0", (needle,)
        return f"substr(lower({column}), 1, ?) = ?", (len(needle), needle)
    try:
        typed = convert_value(kind if kind != "email" else "text", value)
    except ValueError:
        # Checked when stored, but the field has been retyped since: no value
        # of its new type equals this one (so only 'ne' holds), none is above
        # or below it.  Never an error: sizes, verify and sending must go on.
        return ("1" if op == "ne" else "0"), ()
    if kind in ("text", "email") and typed is not None:
        column, typed = f"lower({column})", str(typed).lower()
    if op == "eq":
        return f"{column} IS ?", (typed,)
    if op == "ne":
        return f"{column} IS NOT ?", (typed,)
    return f"{column} {'>' if op == 'gt' else '<'} ?", (typed,)


def segment_filter(conn, datasources, match, conditions):
    """``(sql, params)``: a WHERE clause over ``recipient r`` that selects the
    active recipients of a segment.  Counting and sending both use it, so the
    size a client sees is the audience that is sent to.

    In a datasource that lacks a condition's field, every recipient's value
    is taken as blank: ``empty`` and ``ne`` hold, every other op fails, just as
    for a recipient without a value.  A value that no longer fits its field's
    type (the field was retyped) equals no value.
    """
    if not datasources:
        return "0", ()
    parts, params = [], []
    for datasource in datasources:
        fields = datasource_fields(conn, datasource)
        tests, test_params = [], []
        for condition in conditions:
            name, op, value = condition["field"].lower(), condition["op"], condition.get("value")
            if name == "email":
                sql, args = _condition_sql("r.email", "email", op, value)
            elif name in fields:
                field_id, _, kind = fields[name]
                column = f"json_extract(r.data, '$.\"{int(field_id)}\"')"
                sql, args = _condition_sql(column, kind, op, value)
            else:
                sql, args = ("1", ()) if op in ("empty", "ne") else ("0", ())
            tests.append(sql)
            test_params.extend(args)
        joiner = " AND " if match == "all" else " OR "
        test = joiner.join(tests) if tests else "1"
        parts.append(f"(r.datasource = ? AND ({test}))")
        params.extend([datasource, *test_params])
    return f"r.status = 'active' AND ({' OR '.join(parts)})", tuple(params)


def _checked_datasources(conn, account, given):
    """Segment ``datasources`` as a list of ids the account owns and uses."""
    ids = []
    for index, item in enumerate(given):
        datasource = _as_int(item)
        if datasource is None:
            raise InvalidParameter(f"datasources[{index}] must be a datasource id.",
                                   field="datasources")
        get_owned(conn, DATASOURCE, account, datasource, live=True)
        if datasource not in ids:
            ids.append(datasource)
    return ids


def _checked_conditions(conn, datasources, given):
    """Segment ``conditions`` as stored: ``[{field, op, value}]``, each naming
    a field of the segment's datasources with a value its type takes."""
    fields = [datasource_fields(conn, datasource) for datasource in datasources]
    checked = []
    for index, item in enumerate(given):
        where = f"conditions[{index}]"
        if not isinstance(item, dict) or set(item) - {"field", "op", "value"} \
                or not isinstance(item.get("field"), str) or not item["field"].strip():
            raise InvalidParameter(f"{where} must be an object with 'field', 'op' and 'value'.",
                                   field="conditions")
        name, op, value = item["field"].strip(), item.get("op"), item.get("value")
        if op not in SEGMENT_OPS:
            raise InvalidParameter(f"{where}.op must be one of {', '.join(SEGMENT_OPS)}.",
                                   field="conditions", allowed=list(SEGMENT_OPS))
        kinds = {"email"} if name.lower() == "email" else {
            known[name.lower()][2] for known in fields if name.lower() in known}
        if not kinds:
            raise InvalidParameter(f"{where}: no datasource of this segment has a field "
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
                    convert_value(kind, str(value))  # as it is stored and used
                except ValueError as error:
                    raise InvalidParameter(f"{where}.value does not fit the {kind} field "
                                           f"'{name}': {error}.", field="conditions") from None
        checked.append({"field": name, "op": op, "value": str(value)})
    return checked


def _segment_values(call, row):
    values = _columns(call, ("name", "match"))
    if "datasources" in call.params:
        datasources = _checked_datasources(call.conn, call.account, call.params["datasources"])
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


def segment_query(conn, segment):
    """``(where, params)`` over ``recipient r`` for a segment row: its active
    recipients, in those of its datasources that are not deleted."""
    live = [row[0] for row in conn.execute(
        "SELECT id FROM datasource WHERE deleted = 0 AND id IN "
        "(SELECT value FROM json_each(?)) ORDER BY id", (segment["datasources"],))]
    return segment_filter(conn, live, segment["match"], json.loads(segment["conditions"]))


def segment_size(conn, segment):
    """How many addresses a segment reaches: one address in two of its
    datasources counts once.  Counted by SQLite, never loaded into Python."""
    where, params = segment_query(conn, segment)
    return conn.execute(f"SELECT count(DISTINCT lower(r.email)) FROM recipient r WHERE {where}",
                        params).fetchone()[0]


def _segment_record(conn, row):
    return {"id": str(row["id"]), "owner": str(row["owner"]), "name": row["name"],
            "datasources": [str(d) for d in json.loads(row["datasources"])],
            "match": row["match"], "conditions": json.loads(row["conditions"]),
            "size": str(segment_size(conn, row)), "created": row["created"],
            "deleted": str(row["deleted"])}


SEGMENT = Resource("segment", "segment", _segment_record, _segment_values)


# ---------------------------------------------------------------------------
# Campaigns
# ---------------------------------------------------------------------------

def _campaign_record(conn, row):
    return {"id": str(row["id"]), "owner": str(row["owner"]),
            "accountprofile": str(row["accountprofile"]), "name": row["name"],
            "description": row["description"], "enabled": str(row["enabled"]),
            "scheduled": str(row["scheduled"]), "archiveemail": row["archiveemail"],
            "defaulttemplate": row["defaulttemplate"], "created": row["created"],
            "deleted": str(row["deleted"]), "thumbnail": row["thumbnail"],
            "archiveid": str(row["id"])}


_CAMPAIGN_COLUMNS = ("name", "description", "enabled", "archiveemail", "defaulttemplate",
                     "thumbnail", "accountprofile")


def _campaign_values(call, row=None):
    if call.get("scheduled") == 1:
        raise InvalidParameter("A campaign is scheduled by sending it (PUT /campaign/{id}/send/0); "
                               "'scheduled' only takes '0', to cancel.", field="scheduled")
    values = _columns(call, _CAMPAIGN_COLUMNS)
    for name in ("archiveemail", "thumbnail"):
        if values.get(name) == "":
            values[name] = None
    return values


# `scheduled` is derived, not stored: 1 while the campaign has a batch waiting
# for its time.
CAMPAIGN = Resource("campaign", "campaign", _campaign_record, _campaign_values,
                    columns="*, EXISTS (SELECT 1 FROM batch WHERE batch.campaign = campaign.id "
                            "AND batch.status = 'scheduled') AS scheduled")


def get_campaign(conn, account, campaign_id, *, live=False):
    return get_owned(conn, CAMPAIGN, account, campaign_id, live=live)


def campaign_get(call, id):
    # The spec answers an array under emt_campaign, for one id as for all.
    if id == "all":
        return _listing("emt_campaign", *list_owned(call, CAMPAIGN))
    return {"emt_campaign": [get_record(call, CAMPAIGN, id)["campaign"]]}


def campaign_change(call, id):
    CAMPAIGN.change(call, id)
    if call.get("scheduled") == 0:
        cancel_batches(call.conn, id)
    return True


def campaign_delete(call, id):
    CAMPAIGN.delete(call, id)
    cancel_batches(call.conn, id)
    return True


def cancel_batches(conn, campaign_id):
    """Cancel the campaign's batches that have not started sending."""
    conn.execute("UPDATE batch SET status = 'cancelled', finished = ? "
                 "WHERE campaign = ? AND status = 'scheduled'", (_now(), campaign_id))


# ---------------------------------------------------------------------------
# Campaign messages, structure, verify
# ---------------------------------------------------------------------------

_LINKS = ("SELECT cm.id, cm.campaign, cm.segment, cm.message, cm.priority, m.subject, m.name "
          "FROM campaign_message cm JOIN message m ON m.id = cm.message ")
#: The sending order: lower priority numbers first, then the order of linking.
_LINK_ORDER = " ORDER BY cm.priority, cm.id"


def _link_record(row):
    return {"id": str(row["id"]), "campaign": str(row["campaign"]),
            "segment": str(row["segment"]), "message": str(row["message"]),
            "priority": str(row["priority"]), "subject": row["subject"], "name": row["name"]}


def campaign_links(conn, campaign_id):
    """The campaign's message links (with the message's subject and name) in
    sending order: lower ``priority`` first, then the order they were made."""
    return conn.execute(_LINKS + "WHERE cm.campaign = ?" + _LINK_ORDER, (campaign_id,)).fetchall()


def _get_link(conn, campaign_id, link_id):
    row = conn.execute(_LINKS + "WHERE cm.campaign = ? AND cm.id = ?",
                       (campaign_id, link_id)).fetchone()
    if row is None:
        raise NotFound(f"Campaign {campaign_id} has no campaign message {link_id}.")
    return row


def _link_values(call, campaign_id, link_id=0, link=None):
    """The checked ``segment``, ``message``, ``priority`` of a link: the segment
    and message must be the account's and in use; a duplicate link is 409."""
    values = _columns(call, ("segment", "message", "priority"))
    if "segment" in values:
        get_owned(call.conn, SEGMENT, call.account, values["segment"], live=True)
    if "message" in values:
        get_owned(call.conn, MESSAGE, call.account, values["message"], live=True)
    segment = values.get("segment", link and link["segment"])
    message = values.get("message", link and link["message"])
    duplicate = call.conn.execute(
        "SELECT id FROM campaign_message WHERE campaign = ? AND segment = ? AND message = ? "
        "AND id != ?", (campaign_id, segment, message, link_id)).fetchone()
    if duplicate:
        raise Conflict(f"Campaign {campaign_id} already sends message {message} to segment "
                       f"{segment} (campaign message {duplicate['id']}).")
    return values


def campaign_message_get(call, parent_id, child_id):
    get_campaign(call.conn, call.account, parent_id)
    if child_id != "all":
        return {"message": _link_record(_get_link(call.conn, parent_id, child_id))}
    limit, offset = _page(call)
    total = call.conn.execute("SELECT count(*) FROM campaign_message WHERE campaign = ?",
                              (parent_id,)).fetchone()[0]
    rows = call.conn.execute(_LINKS + "WHERE cm.campaign = ?" + _LINK_ORDER + " LIMIT ? OFFSET ?",
                             (parent_id, limit, offset))
    return _listing("message", [_link_record(row) for row in rows], total, limit, offset)


def campaign_message_create(call, parent_id, child_id):
    get_campaign(call.conn, call.account, parent_id, live=True)
    values = {"campaign": parent_id, **_link_values(call, parent_id)}
    return {"id": str(insert_record(call.conn, "campaign_message", child_id, values))}


def campaign_message_change(call, parent_id, child_id):
    get_campaign(call.conn, call.account, parent_id, live=True)
    link = _get_link(call.conn, parent_id, child_id)
    _same_id(call, "segmentmessageid", child_id)
    update_record(call.conn, "campaign_message", child_id,
                  _link_values(call, parent_id, child_id, link))
    return True


def campaign_message_delete(call, parent_id, child_id):
    get_campaign(call.conn, call.account, parent_id, live=True)
    _get_link(call.conn, parent_id, child_id)
    _same_id(call, "segmentmessagehack", child_id)
    call.conn.execute("DELETE FROM campaign_message WHERE id = ?", (child_id,))
    return True


def _whole_campaign(campaign_id, child_id, what):
    """Structure and verify describe the whole campaign: ``{child_id}`` is 0
    or the campaign's own id."""
    if child_id not in (0, campaign_id):
        raise NotFound(f"Campaign {campaign_id} has one {what}, at "
                       f"/campaign/{campaign_id}/{what}/0.")


def _rows_by_id(conn, table, ids):
    """``{id: row}`` of ``table`` (a fixed name) for the given ids."""
    return {row["id"]: row for row in conn.execute(
        f"SELECT * FROM {table} WHERE id IN (SELECT value FROM json_each(?))",
        (json.dumps(sorted(set(ids))),))}


def segment_overlaps(conn, segments):
    """``{(a, b): addresses in both}`` for every pair of the given segment rows,
    ``(a, a)`` being a segment's size; one SQL statement over the recipients.

    Each segment's addresses are collected once (UNION drops repeats), then the
    collection is joined with itself on the address.
    """
    if not segments:
        return {}
    parts, params = [], []
    for segment in segments:
        where, args = segment_query(conn, segment)
        parts.append(f"SELECT ? AS seg, lower(r.email) AS address FROM recipient r WHERE {where}")
        params.extend([segment["id"], *args])
    sql = (f"WITH m AS MATERIALIZED ({' UNION '.join(parts)}) "
           "SELECT a.seg, b.seg, count(*) FROM m a JOIN m b "
           "ON b.address = a.address AND a.seg <= b.seg GROUP BY a.seg, b.seg")
    counts = {}
    for a, b, shared in conn.execute(sql, params):
        counts[a, b] = counts[b, a] = shared
    return counts


def campaign_structure(conn, account, campaign_id):
    """The structure record: the campaign's segments in sending order with
    their messages, sizes and the addresses each shares with the others.

    An address in several segments receives only the message of the first.
    """
    get_campaign(conn, account, campaign_id)
    entries = {}
    for link in campaign_links(conn, campaign_id):
        entry = entries.setdefault(link["segment"], {
            "segment": str(link["segment"]), "priority": str(link["priority"]), "messages": []})
        entry["messages"].append(str(link["message"]))
    rows = _rows_by_id(conn, "segment", entries)
    counts = segment_overlaps(conn, [rows[segment] for segment in entries])
    segments = []
    for segment, entry in entries.items():
        overlap = [{"segment": str(other), "shared": str(counts.get((segment, other), 0))}
                   for other in entries if other != segment]
        segments.append({"segment": entry["segment"], "name": rows[segment]["name"],
                         "priority": entry["priority"], "messages": entry["messages"],
                         "size": str(counts.get((segment, segment), 0)), "overlap": overlap})
    return {"id": str(campaign_id), "campaign": str(campaign_id), "segments": segments}


def campaign_structure_get(call, parent_id, child_id):
    _whole_campaign(parent_id, child_id, "structure")
    return {"structure": campaign_structure(call.conn, call.account, parent_id)}


def campaign_verify_get(call, parent_id, child_id):
    _whole_campaign(parent_id, child_id, "verify")
    return {"verify": verify_campaign(call.conn, call.account, parent_id)}


def _label(kind, row):
    return f"{kind} {row['id']} ('{row['name']}')" if row["name"] else f"{kind} {row['id']}"


def verify_campaign(conn, account, campaign_id):
    """Check whether campaign ``campaign_id`` can be sent; the verify record.

    Every check is always listed, with ``passed`` '1' or '0' and a message
    that says what to fix and how.  Sending refuses a campaign whose record
    says ``passed: '0'`` (409 verification_failed, with the checks).

    :param conn: a connection (see connect()).
    :param account: the id of the account that owns the campaign (404 if not).
    :param campaign_id: the campaign to check.
    """
    campaign = get_campaign(conn, account, campaign_id)
    cid, pid = campaign_id, campaign["accountprofile"]
    profile = conn.execute("SELECT * FROM accountprofile WHERE id = ? AND owner = ?",
                           (pid, account)).fetchone()
    if profile is not None and profile["deleted"]:
        profile = None
    links = campaign_links(conn, campaign_id)
    messages = _rows_by_id(conn, "message", [link["message"] for link in links])
    segments = _rows_by_id(conn, "segment", [link["segment"] for link in links])
    checks = []

    def check(name, problems, passed_message):
        checks.append({"check": name, "passed": "0" if problems else "1",
                       "message": " ".join(problems) if problems else passed_message})

    check("campaign_enabled", [] if campaign["enabled"] else [
        f"Campaign {cid} is disabled: enable it with POST /v1/campaign/{cid} and enabled '1'."],
        f"Campaign {cid} is enabled.")
    check("campaign_not_deleted", [] if not campaign["deleted"] else [
        f"Campaign {cid} is deleted and cannot be sent any more: create a new campaign."],
        f"Campaign {cid} is not deleted.")
    other = f"point the campaign at another one with POST /v1/campaign/{cid} and accountprofile"
    if profile is not None:
        missing = []
    elif conn.execute("SELECT 1 FROM accountprofile WHERE id = ? AND owner = ?",
                      (pid, account)).fetchone():
        missing = [f"Sender profile {pid} is deleted: {other}."]
    else:
        missing = [f"Sender profile {pid} does not exist: create it with "
                   f"PUT /v1/accountprofile/{pid} (fromname, fromaddress) or {other}."]
    check("sender_profile", missing, f"Sender profile {pid} exists.")
    profile_address = profile is not None and _normalize_email(profile["fromaddress"])
    check("sender_address", [] if profile_address else [
        f"Sender profile {pid} has no valid from address: set fromaddress with "
        f"POST /v1/accountprofile/{pid}." if profile is not None else
        f"There is no sender profile {pid} to send as: the campaign needs one with a valid "
        "fromaddress (see sender_profile)."],
        f"Sender profile {pid} sends as {profile_address}.")
    check("campaign_messages", [] if links else [
        f"Campaign {cid} has no messages: link a message to a segment with "
        f"PUT /v1/campaign/{cid}/message/0 (segment, message)."],
        f"Campaign {cid} has {len(links)} campaign message(s).")
    check("links_in_use", [
        f"{_label(kind, row).capitalize()} is deleted: remove campaign message {link['id']} "
        f"(DELETE /v1/campaign/{cid}/message/{link['id']}) or link another {kind} instead."
        for link in links
        for kind, row in (("message", messages[link["message"]]),
                          ("segment", segments[link["segment"]]))
        if row["deleted"]],
        "No linked message or segment is deleted.")
    check("message_subject", [
        f"{_label('message', m).capitalize()} has no subject: set subject with "
        f"POST /v1/message/{m['id']}." for m in messages.values() if not m["subject"].strip()],
        "Every message has a subject.")
    check("message_from", [
        f"{_label('message', m).capitalize()} has no valid from address: set fromaddress on "
        f"the message (POST /v1/message/{m['id']}) or on sender profile {pid}."
        for m in messages.values()
        if not (_normalize_email(m["fromaddress"]) if m["fromaddress"] else profile_address)],
        "Every message has a valid from address (its own or the sender profile's).")
    check("message_body", [
        f"{_label('message', m).capitalize()} has no body: set html and/or text with "
        f"POST /v1/message/{m['id']}." for m in messages.values()
        if not (m["html"].strip() or m["text"].strip())],
        "Every message has a body.")
    check("unsubscribe_link", [
        f"The {part} body of {_label('message', m)} has no {{{{unsubscribe_url}}}} merge tag: "
        f"add an unsubscribe link to it, e.g. {example}."
        for m in messages.values()
        for part, example in (("html", '<a href="{{unsubscribe_url}}">Unsubscribe</a>'),
                              ("text", "'Unsubscribe: {{unsubscribe_url}}'"))
        if (m[part].strip() or not (m["html"].strip() or m["text"].strip()))
        and "unsubscribe_url" not in merge_tags(m[part])],
        "Every message body carries {{unsubscribe_url}}.")
    check("merge_tags", _unknown_tags(conn, links, messages, segments),
          "Every merge tag names email, unsubscribe_url or a field of the segment's datasources.")
    sizes = {s["id"]: segment_size(conn, s) for s in segments.values()}
    check("segment_recipients", [
        f"{_label('segment', s).capitalize()} has no active recipients: import recipients "
        "into its datasources or loosen its conditions." for s in segments.values() if not sizes[s["id"]]],
        "Every segment has active recipients (" + ", ".join(
            f"segment {s}: {n}" for s, n in sizes.items()) + ").")
    check("segment_definition", [problem for s in segments.values() for problem in _segment_problems(conn, s)],
          "Every segment uses live datasources and fields that exist.")
    archive = campaign["archiveemail"]
    check("archive_email", [] if not archive or _normalize_email(archive) else [
        f"The archive address '{archive}' of campaign {cid} is not a valid email address: "
        f"correct it, or clear it with archiveemail '', with POST /v1/campaign/{cid}."],
        "The archive address is empty or valid.")
    senders = [("message", m, f"/v1/message/{m['id']}") for m in messages.values()]
    if profile is not None:
        senders.append(("sender profile", profile, f"/v1/accountprofile/{pid}"))
    check("reply_to", [
        f"The replyto '{row['replyto']}' of {_label(kind, row)} is not a valid email address: "
        f"correct it with POST {path}." for kind, row, path in senders
        if row["replyto"] and not _normalize_email(row["replyto"])],
        "Every reply-to address is empty or valid.")
    check("header_line_breaks", [
        f"The {column} of {_label(kind, row)} holds a line break, which would break the "
        f"email's headers: set it again on one line with POST {path}."
        for kind, row, path in senders for column in _HEADER_COLUMNS
        if column in row.keys() and ("\r" in row[column] or "\n" in row[column])],
        "No header value holds a line break.")
    passed = all(item["passed"] == "1" for item in checks)
    return {"id": str(cid), "campaign": str(cid), "passed": "1" if passed else "0",
            "checks": checks, "verified": _now()}


def _unknown_tags(conn, links, messages, segments):
    """Problems for merge tags that a message uses and the datasources of a
    segment it is sent to lack as fields (``messages``, ``segments``: by id)."""
    problems = []
    for link in links:
        message, segment = messages[link["message"]], segments[link["segment"]]
        known = {"email", "unsubscribe_url"}
        for datasource in json.loads(segment["datasources"]):
            known.update(datasource_fields(conn, datasource))
        unknown = sorted(set().union(*(merge_tags(message[part])
                                       for part in ("subject", "html", "text"))) - known)
        if unknown:
            tags = ", ".join(f"{{{{{tag}}}}}" for tag in unknown)
            problems.append(
                f"{_label('message', message).capitalize()} uses {tags}, which no datasource of "
                f"{_label('segment', segment)} has as a field: add the field to the datasource "
                f"or correct the tag (POST /v1/message/{message['id']}).")
    return problems


def _segment_problems(conn, segment):
    label = _label("segment", segment).capitalize()
    fix = f"POST /v1/segment/{segment['id']}"
    datasources = json.loads(segment["datasources"])
    if not datasources:
        return [f"{label} has no datasources: set datasources with {fix}."]
    problems, fields = [], set()
    for row in _rows_by_id(conn, "datasource", datasources).values():
        if row["deleted"]:
            problems.append(f"{label} uses datasource {row['id']}, which is deleted: "
                            f"set its datasources again with {fix}.")
        else:
            fields.update(datasource_fields(conn, row["id"]))
    for condition in json.loads(segment["conditions"]):
        name = condition["field"]
        if name.lower() != "email" and name.lower() not in fields:
            problems.append(f"{label} has a condition on the field '{name}', which none of its "
                            f"datasources has (renamed or removed?): correct its conditions "
                            f"with {fix}.")
    return problems


# ---------------------------------------------------------------------------
# Sending: batches, process_due, archives
# ---------------------------------------------------------------------------

def parse_timestamp(value, now=None):
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


def campaign_send(call, parent_id, child_id):
    get_campaign(call.conn, call.account, parent_id, live=True)
    when = parse_timestamp(call.get("timestamp"))
    report = verify_campaign(call.conn, call.account, parent_id)
    if report["passed"] != "1":
        failing = [check for check in report["checks"] if check["passed"] != "1"]
        raise VerificationFailed(
            f"Campaign {parent_id} fails verification: " + " ".join(
                check["message"] for check in failing), checks=report["checks"])
    batch = insert_record(call.conn, "batch", child_id, {
        "campaign": parent_id, "timestamp": when, "status": "scheduled",
        "base_url": call.base_url, "created": _now()})
    return {"id": str(batch)}


def process_due(db, now=None):
    """Make every batch that is due: queue one email per address in the outbox.

    Recipients are resolved in SQL: the campaign's segments in priority order,
    one email per address across segments and datasources (the outbox's unique
    (batch, address) index keeps the first), unsubscribed and bounced
    addresses skipped.  Each batch is made in one transaction, so a crash
    leaves it to be made again whole, and the unique index means a second run
    never queues an address twice.  Also marks sending batches whose emails
    are all delivered as sent.

    :param db: the database path (or an open connection).
    :param now: the current time, 'YYYY-MM-DD HH:MM:SS' UTC (tests pass it).
    :returns: the number of batches made.
    """
    conn = connect(db) if isinstance(db, str) else db
    try:
        now = now or _now()
        made = 0
        while True:
            batch = conn.execute("SELECT * FROM batch WHERE status = 'scheduled' AND timestamp <= ? "
                                 "ORDER BY timestamp, id LIMIT 1", (now,)).fetchone()
            if batch is None:
                break
            with transaction(conn):
                # Looked at before the write lock: another process may have
                # made or cancelled it since.  Only a batch still scheduled is made.
                batch = conn.execute("SELECT * FROM batch WHERE id = ? AND status = 'scheduled'",
                                     (batch["id"],)).fetchone()
                if batch is not None:
                    _make_batch(conn, batch, now)
                    made += 1
        # The worker calls this every second: take the write lock only when
        # some batch is still sending.
        if conn.execute("SELECT 1 FROM batch WHERE status = 'sending' LIMIT 1").fetchone():
            with transaction(conn):
                conn.execute(
                    "UPDATE batch SET status = 'sent', finished = ? WHERE status = 'sending' AND "
                    "NOT EXISTS (SELECT 1 FROM outbox WHERE outbox.batch = batch.id "
                    "AND outbox.status IN ('queued', 'sending'))", (now,))
        return made
    finally:
        if isinstance(db, str):
            conn.close()


def _make_batch(conn, batch, now):
    campaign = conn.execute("SELECT * FROM campaign WHERE id = ?", (batch["campaign"],)).fetchone()
    if campaign["deleted"] or not campaign["enabled"]:
        conn.execute("UPDATE batch SET status = 'cancelled', finished = ? WHERE id = ?",
                     (now, batch["id"]))
        log.info("batch %s cancelled: campaign %s is deleted or disabled", batch["id"], campaign["id"])
        return
    account = campaign["owner"]
    for link in campaign_links(conn, campaign["id"]):
        segment = conn.execute("SELECT * FROM segment WHERE id = ?", (link["segment"],)).fetchone()
        where, params = segment_query(conn, segment)
        conn.execute(
            "INSERT OR IGNORE INTO outbox (account, kind, batch, message, recipient, to_addr, "
            "status, created, next_try) "
            f"SELECT ?, 'campaign', ?, ?, r.id, r.email, 'queued', ?, ? FROM recipient r WHERE {where} "
            "AND NOT EXISTS (SELECT 1 FROM suppression s WHERE s.account = ? AND s.email = r.email) "
            "ORDER BY r.id",
            (account, batch["id"], link["message"], now, now, *params, account))
        _archive_message(conn, campaign, batch, link["message"])
    queued = conn.execute("SELECT count(*) FROM outbox WHERE batch = ? AND kind = 'campaign'",
                          (batch["id"],)).fetchone()[0]
    conn.execute("UPDATE batch SET status = 'sending', recipients = ? WHERE id = ?",
                 (queued, batch["id"]))
    log.info("batch %s of campaign %s: %s emails queued", batch["id"], campaign["id"], queued)


def _archive_message(conn, campaign, batch, message_id):
    """Keep the message as this batch sends it, and mail a copy to archiveemail.

    Per-recipient merge tags stay visible as tags: the archive shows what
    every recipient got, not one recipient's data."""
    message = conn.execute("SELECT * FROM message WHERE id = ?", (message_id,)).fetchone()
    inserted = conn.execute(
        "INSERT OR IGNORE INTO batch_message (batch, message, subject, html, text) "
        "VALUES (?, ?, ?, ?, ?)",
        (batch["id"], message_id, message["subject"], message["html"], message["text"])).rowcount
    if inserted and campaign["archiveemail"]:
        enqueue_email(conn, campaign["owner"], campaign["archiveemail"],
                      f"[archive] {message['subject']}", message["text"], kind="archive",
                      html=message["html"])


def _batch_record(conn, batch, with_messages=True):
    counts = conn.execute(
        "SELECT count(*), sum(status = 'sent'), sum(status = 'failed') FROM outbox "
        "WHERE batch = ? AND kind = 'campaign'", (batch["id"],)).fetchone()
    record = {"id": str(batch["id"]), "campaign": str(batch["campaign"]),
              "timestamp": batch["timestamp"], "status": batch["status"],
              "recipients": str(batch["recipients"]), "queued": str(counts[0]),
              "sent": str(counts[1] or 0), "failed": str(counts[2] or 0),
              "created": batch["created"], "finished": batch["finished"]}
    if with_messages:
        record["messages"] = [
            {"message": str(m["message"]), "subject": m["subject"], "html": m["html"],
             "text": m["text"]} for m in conn.execute(
                "SELECT * FROM batch_message WHERE batch = ? ORDER BY message", (batch["id"],))]
    return record


BATCH = Kind("batcharchive", "batch", _batch_record, soft_delete=False, label="batch")


def batcharchive_get(call, parent_id, child_id):
    get_campaign(call.conn, call.account, parent_id)
    if child_id == "all":
        return _listing("batcharchive", *list_page(call, BATCH, "campaign = ?", (parent_id,)))
    batch = call.conn.execute("SELECT * FROM batch WHERE id = ? AND campaign = ?",
                              (child_id, parent_id)).fetchone()
    if batch is None:
        raise NotFound(f"Campaign {parent_id} has no batch {child_id}.")
    return {"batcharchive": _batch_record(call.conn, batch)}


def archive_get(call, parent_id, child_id):
    # A campaign has one archive, whose id (archiveid) is the campaign's.
    get_campaign(call.conn, call.account, parent_id)
    if child_id not in (0, parent_id):
        raise NotFound(f"Campaign {parent_id} has no archive {child_id}; its archiveid is "
                       f"{parent_id}.")
    batches = [_batch_record(call.conn, row, with_messages=False) for row in call.conn.execute(
        "SELECT * FROM batch WHERE campaign = ? ORDER BY id", (parent_id,)).fetchall()]
    unsubscribed = call.conn.execute(
        "SELECT count(*) FROM suppression WHERE campaign = ? AND reason = 'unsubscribed'",
        (parent_id,)).fetchone()[0]
    return {"archive": {
        "id": str(parent_id), "campaign": str(parent_id), "batches": batches,
        "sent": str(sum(int(b["sent"]) for b in batches)),
        "failed": str(sum(int(b["failed"]) for b in batches)),
        "unsubscribed": str(unsubscribed)}}


# ---------------------------------------------------------------------------
# Rendering and the outbox
# ---------------------------------------------------------------------------

_MERGE_TAG = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")


def merge_tags(template):
    """The names of the merge tags in ``template``, lower-cased."""
    return {name.lower() for name in _MERGE_TAG.findall(template or "")}


def render(template, values, *, as_html=False):
    """Fill ``{{name}}`` merge tags from ``values`` (names without case).

    Plain substitution, no template code: a value is inserted as text, and
    HTML-escaped when ``as_html``.  An unknown tag becomes empty (verify
    reports unknown tags before a campaign can be sent).
    """
    lowered = {name.lower(): value for name, value in values.items()}

    def fill(match):
        value = lowered.get(match.group(1).lower(), "")
        return html.escape(str(value), quote=True) if as_html else str(value)

    return _MERGE_TAG.sub(fill, template or "")


def enqueue_email(conn, account, to_addr, subject, body, kind="notification", html=None):
    """Queue a ready-made email (a notification or an archive copy) in the
    outbox; the worker delivers it.  Returns the outbox row id.

    :param body: the plain-text body; ``html`` an optional HTML alternative.
    """
    return conn.execute(
        "INSERT INTO outbox (account, kind, to_addr, subject, body, html, created, next_try) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (account, kind, to_addr, subject, body, html, _now(), _now())).lastrowid


def account_email(conn, account):
    """The account holder's address, where notifications go."""
    return conn.execute("SELECT email FROM account WHERE id = ?", (account,)).fetchone()["email"]


# ---------------------------------------------------------------------------
# Delivery: MIME, SMTP, DKIM, unsubscribe, the worker
# ---------------------------------------------------------------------------

#: A claim older than this belongs to a worker that died; its rows are queued again.
STALE_CLAIM = datetime.timedelta(minutes=10)
_INTERRUPTED = ("the worker stopped during the SMTP attempt, so the email may have arrived; "
                "not sent again, so that it cannot arrive twice")
#: Retry after a 4xx reply: RETRY_BASE * 2**attempts seconds, at most RETRY_CAP.
RETRY_BASE, RETRY_CAP = 30, 3600
#: Seconds before rows are tried again after the SMTP server could not be reached.
CONNECTION_RETRY = 30
MAX_ATTEMPTS = 8
#: Seconds between progress lines in the log while a delivery runs.
PROGRESS_INTERVAL = 10


def default_mail_from():
    """The sender of notifications and archive copies unless one is configured."""
    return f"campaignapi@{socket.gethostname() or 'localhost'}"


def _time_text(moment):
    """A time as stored ('YYYY-MM-DD HH:MM:SS' UTC) from a datetime or that text."""
    if moment is None:
        return _now()
    if isinstance(moment, datetime.datetime):
        if moment.tzinfo is not None:
            moment = moment.astimezone(datetime.timezone.utc)
        return moment.strftime("%Y-%m-%d %H:%M:%S")
    return str(moment)


def _shift(moment_text, seconds):
    moment = datetime.datetime.strptime(moment_text, "%Y-%m-%d %H:%M:%S")
    return (moment + datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%d %H:%M:%S")


# Unsubscribe tokens: signed, not stored. ------------------------------------

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


def _token_mac(secret, payload):
    # 128 bits of HMAC-SHA256 keep the link short and still unforgeable.
    return hmac.new(secret.encode("utf-8"), b"unsubscribe:" + payload, hashlib.sha256).digest()[:16]


def unsubscribe_token(secret, account, address, campaign=None):
    """A token naming ``address`` of ``account`` (and the campaign that mailed
    it), signed with ``secret``: base64url(payload) "." base64url(mac)."""
    payload = f"{account}:{campaign or ''}:{address}".encode("utf-8")
    return f"{_b64(payload)}.{_b64(_token_mac(secret, payload))}"


def read_unsubscribe_token(secret, token):
    """``(account, address, campaign or None)`` of a token we signed, else None."""
    try:
        payload_text, mac_text = token.split(".")
        payload, mac = _unb64(payload_text), _unb64(mac_text)
        if not hmac.compare_digest(mac, _token_mac(secret, payload)):
            return None
        account, campaign, address = payload.decode("utf-8").split(":", 2)
        return int(account), address, int(campaign) if campaign else None
    except (ValueError, binascii.Error):
        return None


def unsubscribe_url(secret, base, account, address, campaign=None):
    """The one-click unsubscribe link of ``address`` for the account's mail.

    :param base: where the API is reachable (public_url or a batch's base_url).
    """
    return f"{base.rstrip('/')}/v1/unsubscribe/{unsubscribe_token(secret, account, address, campaign)}"


def suppress(conn, account, address, reason, campaign=None):
    """Stop the account's campaigns reaching ``address``: a suppression row
    and the status of every recipient row of the account with that address.

    :param reason: 'unsubscribed' (replaces a bounce) or 'bounced' (never
        replaces an unsubscribe).
    """
    conn.execute(
        "INSERT INTO suppression (account, email, reason, campaign, created) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (account, email) DO UPDATE SET reason = excluded.reason, "
        "campaign = excluded.campaign, created = excluded.created "
        "WHERE excluded.reason = 'unsubscribed' AND suppression.reason = 'bounced'",
        (account, address, reason, campaign, _now()))
    replaces = "bounced" if reason == "unsubscribed" else "active"
    conn.execute(
        "UPDATE recipient SET status = ?, updated = ? WHERE email = ? "
        "AND status IN ('active', ?) AND datasource IN (SELECT id FROM datasource WHERE owner = ?)",
        (reason, _now(), address, replaces, account))


_UNSUBSCRIBE_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">
<title>{title}</title>
<style>body{{font:16px/1.5 system-ui,sans-serif;max-width:32em;margin:3em auto;padding:0 1em;color:#222}}
button{{font:inherit;padding:.5em 1.2em;cursor:pointer}}</style></head>
<body><h1>{title}</h1>{body}</body></html>
"""


def _page_response(title, body, status=200):
    return bottle.HTTPResponse(
        _UNSUBSCRIBE_PAGE.format(title=html.escape(title), body=body), status=status,
        headers={"Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-store",
                 "X-Robots-Tag": "noindex"})


def _unsubscribe_subject(call, token):
    subject = read_unsubscribe_token(call.service.secret, token)
    if subject is None:
        raise NotFound("This unsubscribe link is not valid; copy the whole link from the email.")
    return subject


def unsubscribe_page(call, token):
    # GET never unsubscribes: mail scanners and link previews fetch links.
    _, address, _ = _unsubscribe_subject(call, token)
    return _page_response("Unsubscribe", (
        f"<p>Stop sending emails to <strong>{html.escape(address)}</strong>?</p>"
        '<form method="post"><input type="hidden" name="List-Unsubscribe" value="One-Click">'
        '<button type="submit">Unsubscribe</button></form>'))


def unsubscribe_post(call, token):
    # RFC 8058 one-click, and the confirm button of the page: both at once.
    account, address, campaign = _unsubscribe_subject(call, token)
    suppress(call.conn, account, address, "unsubscribed", campaign)
    return _page_response("Unsubscribed", (
        f"<p><strong>{html.escape(address)}</strong> will receive no more of these emails.</p>"))


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
    render() gives, at a fraction of the cost, for recipient after recipient."""

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


class Letter:
    """One kind of email (a sender and a message's templates), ready to be
    built for each recipient with build()."""

    def __init__(self, sender, subject, text, html_body="", *, from_name="", reply_to="",
                 list_id=None, templated=True):
        """:param templated: fill merge tags from the values given to build()."""
        self.sender = sender
        self.domain = sender.rpartition("@")[2] or "localhost"
        self.subject = _Template(subject) if templated and merge_tags(subject) else None
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

    def build(self, to_addr, values=None, unsubscribe=None):
        """The email to ``to_addr`` as bytes (RFC 5322, CRLF line ends).

        :param values: merge values, ``{name: str}``; names without case.
        """
        values = {name.lower(): str(value) for name, value in (values or {}).items()}
        head = [self.head, _header("To", to_addr), b"Date: ", email.utils.formatdate(usegmt=True).encode(),
                b"\r\nMessage-ID: ", email.utils.make_msgid(domain=self.domain).encode(), b"\r\n"]
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


_COUNTS = ("sent", "retried", "failed", "bounced", "skipped", "requeued")


class _Unreachable(Exception):
    """The SMTP server cannot be reached or dropped the connection."""


def _transact(smtp, sender, recipient, data):
    """One mail transaction on an open connection: None when the email is
    accepted, else the refusing ``(code, reply)``.

    The exchange of smtplib's sendmail(), without what it repeats for every
    email: parsing both addresses again (ours are checked) and dot-stuffing
    with a regular expression (our line ends are all CRLF).  A server that
    offers PIPELINING (RFC 2920; every common relay does) gets MAIL, RCPT and
    DATA in one write: two round trips an email instead of four, and a
    sender mostly waits on round trips.
    """
    commands = (f"MAIL FROM:<{sender}>", f"RCPT TO:<{recipient}>", "DATA")
    expected = ((250,), (250, 251), (354,))
    replies = []
    if smtp.does_esmtp and smtp.has_extn("pipelining"):
        smtp.send("".join(command + "\r\n" for command in commands))
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
        smtp.send(data.replace(b"\n.", b"\n..") + b".\r\n")
        code, reply = smtp.getreply()
        # After the final dot the transaction is over either way.
        return None if code == 250 else (code, reply)
    if replies[-1][0] == 354:  # pipelined DATA went through after a refusal: end it empty
        smtp.send(b".\r\n")
        smtp.getreply()
    if code != 421:  # 421: the server is closing; nothing to reset
        smtp.docmd("RSET")
    return code, reply


class _Courier:
    """One SMTP connection with its own database connection: claims rows of
    the outbox, sends them, records what happened."""

    def __init__(self, run):
        self.run = run
        self.conn = connect(run.db)
        self.smtp = None
        self.letters, self.fields = {}, {}  # per (batch, message) and per datasource

    # The database side.

    def claim(self):
        due = self.run.now or _now()
        with transaction(self.conn):
            return self.conn.execute(
                "UPDATE outbox SET status = 'sending', claimed_by = ?, claimed_at = ? "
                "WHERE id IN (SELECT id FROM outbox WHERE status = 'queued' AND next_try <= ? "
                "ORDER BY next_try LIMIT ?) AND status = 'queued' "
                "RETURNING id, account, kind, batch, message, recipient, to_addr, subject, body, "
                "html, attempts", (self.run.worker_id, _now(), due, self.run.chunk)).fetchall()

    def recipients(self, rows):
        ids = [row["recipient"] for row in rows if row["kind"] == "campaign"]
        if not ids:
            return {}
        marks = ", ".join("?" * len(ids))
        return {r["id"]: r for r in self.conn.execute(
            "SELECT r.id, r.datasource, r.email, r.data, r.status, s.reason AS suppressed "
            "FROM recipient r JOIN datasource d ON d.id = r.datasource "
            "LEFT JOIN suppression s ON s.account = d.owner AND s.email = r.email "
            f"WHERE r.id IN ({marks})", ids)}

    def record(self, results, bounces, attempting=None):
        """Write the outcomes so far (and empty the lists); with ``attempting``,
        in the same transaction mark that row's SMTP attempt as under way.

        Called before every SMTP attempt, so an email the server accepted is
        never more than one attempt away from being recorded: a worker
        killed mid-chunk leaves only its one attempting row in doubt."""
        with transaction(self.conn):
            self.conn.executemany(
                "UPDATE outbox SET status = ?, attempts = ?, next_try = coalesce(?, next_try), "
                "error = ?, sent = ?, claimed_by = NULL, claimed_at = NULL, "
                "attempt_started = NULL WHERE id = ?", results)
            for account, address, campaign in bounces:
                suppress(self.conn, account, address, "bounced", campaign)
            if attempting is not None:
                self.conn.execute("UPDATE outbox SET attempt_started = ? WHERE id = ?",
                                  (_now(), attempting))
        results.clear()
        bounces.clear()

    # Building the emails.

    def campaign_letter(self, batch_id, message_id):
        key = (batch_id, message_id)
        letter = self.letters.get(key)
        if letter is None:
            batch = self.conn.execute(
                "SELECT b.base_url, c.id AS campaign, c.owner, c.accountprofile "
                "FROM batch b JOIN campaign c ON c.id = b.campaign WHERE b.id = ?",
                (batch_id,)).fetchone()
            message = self.conn.execute("SELECT * FROM message WHERE id = ?",
                                        (message_id,)).fetchone()
            if batch is None or message is None:
                raise LookupError(f"batch {batch_id} or message {message_id} does not exist")
            # The content as the batch archived it when it was made, so an edit
            # of the message after the send changes no email still queued.
            sent_as = self.conn.execute(
                "SELECT subject, html, text FROM batch_message WHERE batch = ? AND message = ?",
                (batch_id, message_id)).fetchone() or message
            profile = self.conn.execute(
                "SELECT fromname, fromaddress, replyto FROM accountprofile WHERE id = ?",
                (batch["accountprofile"],)).fetchone()
            profile = dict(profile) if profile else {}

            def pick(name):
                return message[name] or profile.get(name) or ""

            letter = Letter(pick("fromaddress") or self.run.mail_from, sent_as["subject"],
                            sent_as["text"], sent_as["html"], from_name=pick("fromname"),
                            reply_to=pick("replyto"),
                            list_id=f"<campaign-{batch['campaign']}.{batch['owner']}.campaignapi>")
            letter.campaign, letter.account = batch["campaign"], batch["owner"]
            letter.base = (batch["base_url"] or self.run.public_url).rstrip("/")
            self.letters[key] = letter
        return letter

    def datasource_fields(self, datasource):
        fields = self.fields.get(datasource)
        if fields is None:
            fields = self.fields[datasource] = datasource_fields(self.conn, datasource)
        return fields

    def build(self, row, recipients):
        """``(sender, email bytes)``, or None when the row must not be sent."""
        if row["kind"] != "campaign":
            letter = Letter(self.run.mail_from, row["subject"] or "", row["body"] or "",
                            row["html"] or "", templated=False)
            return letter.sender, letter.build(row["to_addr"])
        recipient = recipients.get(row["recipient"])
        if recipient is None or recipient["status"] != "active" or recipient["suppressed"]:
            return None
        letter = self.campaign_letter(row["batch"], row["message"])
        values = recipient_values(self.datasource_fields(recipient["datasource"]), recipient)
        link = None
        if letter.base:
            link = unsubscribe_url(self.run.secret, letter.base, letter.account, row["to_addr"],
                                   letter.campaign)
        values["unsubscribe_url"] = link or ""
        return letter.sender, letter.build(row["to_addr"], values, link)

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
        if self.smtp is not None:
            try:
                self.smtp.quit() if polite else self.smtp.close()
            except (OSError, smtplib.SMTPException):
                self.smtp.close()
            self.smtp = None

    def send(self, sender, to_addr, data):
        """None when accepted, else ``(code, reply text)``; _Unreachable when
        the connection is lost."""
        if self.smtp is None:
            self.connect()
        try:
            answer = _transact(self.smtp, sender, to_addr, data)
        except (OSError, smtplib.SMTPException) as error:
            self.hang_up(polite=False)
            raise _Unreachable(f"SMTP connection lost: {error}") from None
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
        run, results, bounces = self.run, [], []
        counts = dict.fromkeys(_COUNTS, 0)
        recipients = self.recipients(rows)
        unreachable = None
        for row in rows:
            attempts = row["attempts"] + 1
            if unreachable or run.stop.is_set():
                # Not tried: back to the queue as it was (later if the server is down).
                results.append(("queued", row["attempts"], unreachable and _shift(_now(), CONNECTION_RETRY),
                                unreachable, None, row["id"]))
                counts["requeued"] += 1
                continue
            try:
                built = self.build(row, recipients)
            except Exception as error:  # bad data in this row must not stop the others
                log.exception("outbox %s cannot be built", row["id"])
                results.append(("failed", attempts, None, f"cannot build the email: {error}", None,
                                row["id"]))
                counts["failed"] += 1
                continue
            if built is None:
                results.append(("skipped", row["attempts"], None,
                                "the recipient unsubscribed, bounced or was removed", None, row["id"]))
                counts["skipped"] += 1
                continue
            sender, data = built
            if not (sender.isascii() and row["to_addr"].isascii()):
                results.append(("failed", attempts, None, "non-ASCII addresses need SMTPUTF8, "
                                "which campaignapi does not send", None, row["id"]))
                counts["failed"] += 1
                continue
            run.pace.wait(run.stop)
            if run.sign:
                data = run.sign(data)
            self.record(results, bounces, attempting=row["id"])
            try:
                reply = self.send(sender, row["to_addr"], data)
            except _Unreachable as error:
                unreachable = str(error)
                results.append(("queued", row["attempts"], _shift(_now(), CONNECTION_RETRY),
                                unreachable, None, row["id"]))
                counts["requeued"] += 1
                continue
            if reply is None:
                results.append(("sent", attempts, None, None, _now(), row["id"]))
                counts["sent"] += 1
                continue
            code, text = reply
            error = f"{code} {text}"
            if 400 <= code < 500 and attempts < run.max_attempts:
                delay = min(RETRY_BASE * 2 ** row["attempts"], RETRY_CAP)
                results.append(("queued", attempts, _shift(_now(), delay), error, None, row["id"]))
                counts["retried"] += 1
                continue
            results.append(("failed", attempts, None, error, None, row["id"]))
            counts["failed"] += 1
            if row["kind"] == "campaign" and code >= 500 and text.startswith("5.1."):
                # A hard bounce: the mailbox does not exist.
                letter = self.letters[(row["batch"], row["message"])]
                bounces.append((row["account"], row["to_addr"], letter.campaign))
                counts["bounced"] += 1
        self.record(results, bounces)
        run.add(counts, unreachable)
        return unreachable


def smtp_address(smtp):
    """``(host, port)`` of a ``"host:port"`` setting ("[::1]:25" for IPv6)."""
    host, _, port = (smtp or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"the SMTP server must be given as host:port, not {smtp!r}")
    return host.strip("[]"), int(port)


class _Run:
    """What the connections of one deliver() call share."""

    def __init__(self, db, address, options):
        self.db = db
        self.host, self.port = address
        self.__dict__.update(options)
        self.pace = _RateLimit(self.rate)
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(_COUNTS, 0)
        self.error = None
        self.reported = dict(self.counts)
        self.next_report = time.monotonic() + PROGRESS_INTERVAL

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
        self.reported, self.next_report = dict(self.counts), time.monotonic() + PROGRESS_INTERVAL
        conn = connect(self.db)
        try:
            queued = conn.execute("SELECT count(*) FROM outbox WHERE status IN "
                                  "('queued', 'sending')").fetchone()[0]
        finally:
            conn.close()
        log.info("delivery progress: %s sent, %s failed, %s retried in the last %ss; "
                 "%s sent and %s failed in all; %s still queued", done["sent"], done["failed"],
                 done["retried"], PROGRESS_INTERVAL, self.counts["sent"], self.counts["failed"],
                 queued)


def deliver(db, smtp="localhost:25", *, starttls=False, username=None, password=None,
            connections=1, rate=None, batch_size=100, worker_id=None, dkim=None, public_url="",
            mail_from=None, secret=None, max_attempts=MAX_ATTEMPTS, timeout=60, now=None,
            stop=None, stale_claim=STALE_CLAIM):
    """Send the outbox rows that are due over SMTP; returns counts.

    Each row is claimed in a short transaction before it is sent, so workers
    running side by side never send the same row; a claim older than
    ``stale_claim`` (a worker that died) is taken back.  Each outcome is
    written before the next SMTP attempt starts, so of a dead worker's rows
    only the one it was sending is in doubt: that one is failed, never sent
    twice; the others are queued again.  A 4xx reply queues the
    row again with backoff until ``max_attempts``; a 5xx reply fails it, and
    a ``5.1.x`` reply to a campaign email marks the address bounced for the
    account.  Campaign emails are rendered here, from the message and the
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
    :param stale_claim: how old a claim must be (a timedelta) before it counts as a dead
        worker's; it must be longer than any live worker takes over one chunk.
    :returns: ``{"sent", "retried", "failed", "bounced", "skipped", "requeued": n, "error": str|None}``.
    """
    address = smtp_address(smtp)
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
                # A row the dead worker was sending may have arrived: at most once.
                conn.execute("UPDATE outbox SET status = 'failed', error = ?, claimed_by = NULL, "
                             "claimed_at = NULL, attempt_started = NULL WHERE status = 'sending' "
                             "AND claimed_at < ? AND attempt_started IS NOT NULL",
                             (_INTERRUPTED, stale))
                conn.execute("UPDATE outbox SET status = 'queued', claimed_by = NULL, "
                             "claimed_at = NULL WHERE status = 'sending' AND claimed_at < ?", (stale,))
    finally:
        conn.close()
    if not (due or dead):
        return {**dict.fromkeys(_COUNTS, 0), "error": None}
    # A claim must be sent well before it goes stale: claim about a minute's work.
    chunk = batch_size if not rate else max(1, min(batch_size, int(rate * 60 / connections)))
    run = _Run(db, address, dict(
        starttls=starttls, username=username, password=password, rate=rate, chunk=chunk,
        worker_id=worker_id or f"{socket.gethostname()}:{os.getpid()}",
        sign=dkim_signer(*dkim) if dkim else None, public_url=public_url or "",
        mail_from=mail_from or default_mail_from(), secret=secret, max_attempts=max_attempts,
        timeout=timeout, now=_time_text(now) if now is not None else None,
        stop=stop or threading.Event()))
    couriers = [_Courier(run) for _ in range(max(1, connections))]
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
    return {**run.counts, "error": run.error}


# The worker ------------------------------------------------------------------

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
                log.warning("%s: %s", name, error)
            else:
                log.exception("%s failed", name)
        if not busy:
            stop.wait(min(interval * 2 ** min(failures, 6), 60.0))


def run_worker(db, stop_event, smtp=None, *, interval=1.0, **delivery):
    """The background work, until ``stop_event`` is set: make due batches
    (process_due) and, when ``smtp`` is given, deliver the outbox (deliver()
    with ``delivery`` options).  Without SMTP the outbox fills and waits.

    :param interval: seconds between looks for due work when idle.
    """
    def make_batches():
        return process_due(db) > 0

    def deliver_outbox():
        counts = deliver(db, smtp, stop=stop_event, **delivery)
        if any(counts[name] for name in ("sent", "retried", "failed", "skipped")):
            log.info("delivered: %s", ", ".join(f"{v} {k}" for k, v in counts.items()
                                                if v and k != "error"))
        if counts["error"]:
            raise ConnectionError(counts["error"])
        return counts["sent"] + counts["failed"] + counts["retried"] > 0

    steps = [("batches", make_batches)] + ([("delivery", deliver_outbox)] if smtp else [])
    threads = [threading.Thread(target=_repeat, args=(stop_event, interval, step, name),
                                name=f"campaignapi-{name}", daemon=True) for name, step in steps]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        for thread in threads:
            thread.join(0.5)


# ---------------------------------------------------------------------------
# OpenAPI
# ---------------------------------------------------------------------------

_STRING_OR_NULL = {"type": ["string", "null"]}
_FLAG_ANSWER = {"enum": ["0", "1"]}
_ID_LIST = {"type": "array", "items": {"type": "string"}}


def _record_schema(names, /, **special):
    """A record as the contract answers it: every field of ``names`` present,
    each a string or null unless ``special`` gives its schema."""
    names = names.split()
    return {"type": "object", "required": names,
            "properties": {name: special.get(name, _STRING_OR_NULL) for name in names}}


#: The records of the contract (API.md sections 4-7) as JSON schemas, by kind.
RECORD_SCHEMAS = {
    "datasource": _record_schema(
        "id owner name description origin fields recipients created deleted",
        origin={"enum": ["import", "signup", "api"]}, deleted=_FLAG_ANSWER,
        fields={"type": "array", "items": _record_schema(
            "id name type", type={"enum": list(FIELD_TYPES)})}),
    "recipient": _record_schema(
        "id datasource email fields status created updated",
        fields={"type": "object", "additionalProperties": _STRING_OR_NULL},
        status={"enum": ["active", "unsubscribed", "bounced"]}),
    "field": _record_schema("id name type", type={"enum": list(FIELD_TYPES)}),
    "import": _record_schema(
        "id datasource name originalfile uploadtype status rows inserted updated skipped "
        "errors created finished",
        errors={"type": "array", "items": {"type": "object", "properties": {
            "row": _STRING_OR_NULL, "error": {"type": "string"}}}}),
    "export": _record_schema("id datasource status rows url expires created finished"),
    "organize": _record_schema("id item folder sortorder"),
    "message": _record_schema(
        "id owner name subject fromname fromaddress replyto html text created deleted",
        deleted=_FLAG_ANSWER),
    "segment": _record_schema(
        "id owner name datasources match conditions size created deleted",
        datasources=_ID_LIST, match={"enum": ["all", "any"]}, deleted=_FLAG_ANSWER,
        conditions={"type": "array", "items": {"type": "object", "required": ["field", "op"],
                                               "properties": {"field": {"type": "string"},
                                                              "op": {"type": "string"},
                                                              "value": {}}}}),
    "accountprofile": _record_schema("id owner name fromname fromaddress replyto"),
    "campaign": _record_schema(
        "id owner accountprofile name description enabled scheduled archiveemail "
        "defaulttemplate created deleted thumbnail archiveid",
        enabled=_FLAG_ANSWER, scheduled=_FLAG_ANSWER, deleted=_FLAG_ANSWER),
    "campaignmessage": _record_schema("id campaign segment message priority subject name"),
    "structure": _record_schema(
        "id campaign segments",
        segments={"type": "array", "items": {"type": "object", "properties": {
            "segment": {"type": "string"}, "name": _STRING_OR_NULL,
            "priority": {"type": "string"}, "messages": _ID_LIST,
            "size": {"type": "string"}, "overlap": {}}}}),
    "verify": _record_schema(
        "id campaign passed checks verified", passed=_FLAG_ANSWER,
        checks={"type": "array", "items": {"type": "object", "properties": {
            "check": {"type": "string"}, "passed": {}, "message": {"type": "string"}}}}),
    "batcharchive": _record_schema(
        "id campaign timestamp status recipients queued sent failed messages",
        status={"enum": ["scheduled", "sending", "sent", "cancelled"]},
        messages={"type": "array", "items": {"type": "object"}}),
    "archive": _record_schema("id campaign batches sent failed unsubscribed",
                              batches={"type": "array", "items": {"type": "object"}}),
}

#: Success data of a create: the new record's id.
ANSWER_ID = {"type": "object", "required": ["id"],
             "properties": {"id": {"type": "string", "pattern": "^[0-9]+$"}}}
#: Success data of a change or a delete.
ANSWER_DONE = {"const": True}


def records_answer(key, kind):
    """Success data that lists records of ``kind`` under ``key`` for one id as
    for ``all`` (the spec's ``emt_campaign``); pages add total, limit, offset."""
    return {"type": "object", "required": [key], "properties": {
        key: {"type": "array", "items": {"$ref": f"#/components/schemas/{kind}"}},
        **{name: {"type": "string"} for name in ("total", "limit", "offset")}}}


_OPENAPI_VERBS = {"GET": "Get", "PUT": "Create", "POST": "Change", "DELETE": "Delete"}

_QUERY_TYPES = {
    "int": {"type": "integer", "minimum": 0, "maximum": MAX_ID},
    "flag": {"enum": ["0", "1", "true", "false"]},
}

_BODY_TYPES = {
    "str": {"type": "string", "pattern": "^[^\\r\\n\\x00]*$", "description": "one line"},
    "text": {"type": "string", "pattern": "^[^\\x00]*$"},
    "int": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": MAX_ID},
                      {"type": "string", "pattern": "^[0-9]{1,19}$"}]},
    "flag": {"enum": ["0", "1", 0, 1, True, False, "true", "false"]},
    "email": {"anyOf": [{"const": ""}, {"type": "string", "format": "email"}],
              "description": "an email address, or '' for none"},
    "list": {"type": "array"},
    "scalar": {"type": ["string", "number"]},
    "data": {"type": ["string", "array", "object"], "description": "the upload: CSV text, base64, or "
             "(for json uploads) an array of objects"},
}


#: Bounds of the page parameters that every listing shares (_page()).
_PAGE_BOUNDS = {"limit": {"minimum": 1, "maximum": PAGE_MAX, "default": PAGE_DEFAULT},
                "offset": {"minimum": 0, "default": 0}}


def _param_schema(param, in_query=False):
    if param.choices is not None:
        return {"type": "string", "enum": list(param.choices)}
    if in_query and param.type in _QUERY_TYPES:
        schema = dict(_QUERY_TYPES[param.type])
    else:
        schema = dict(_BODY_TYPES.get(param.type, {}))
    if param.type == "int" and param.name in _PAGE_BOUNDS:
        if "oneOf" in schema:
            schema = {"oneOf": [{**schema["oneOf"][0], **_PAGE_BOUNDS[param.name]},
                                schema["oneOf"][1]]}
        else:
            schema.update(_PAGE_BOUNDS[param.name])
    return schema


def _id_parameter(name, allowed):
    """A path placeholder as an OpenAPI parameter: what its segment accepts."""
    if "name" in allowed:
        schema, text = {"type": "string", "minLength": 1}, "an id or a name"
    else:
        words = [word for word in allowed if word != "int"]
        choices = (["[0-9]{1,19}"] if "int" in allowed else []) + [re.escape(w) for w in words]
        schema = {"type": "string", "pattern": "^(" + "|".join(choices) + ")$"}
        text = " or ".join((["an integer id"] if "int" in allowed else [])
                           + [f"'{word}'" for word in words])
    return {"name": name, "in": "path", "required": True, "schema": schema,
            "description": text}


def _error_codes():
    """``{status: [codes]}`` of every ApiError class: the contract's section 2."""
    codes, classes = {}, [ApiError]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        codes.setdefault(cls.status, set()).add(cls.code)
    return {status: sorted(found) for status, found in sorted(codes.items())}


def _route_statuses(route):
    """The error statuses a route can answer, from what the pipeline does for it."""
    statuses = {400, 413, 415, 500}     # parameters and body are read on every route
    if route.level:
        statuses |= {401, 403}
    if route.ids:
        statuses.add(404)
    if route.writes:
        statuses |= {409, 422}
    return sorted(statuses)


def _success_data(route):
    """The JSON schema of ``data`` when ``route`` succeeds."""
    answers = route.answers
    literal = [part for part in route.path.split("/") if part and not part.startswith("{")]
    if answers is None and route.method == "GET" and literal and literal[-1] in RECORD_SCHEMAS:
        answers = literal[-1]       # GET /.../{kind}/{id} answers that kind's records
    if isinstance(answers, dict):
        return answers
    # (key, kind) where the answer's key is not the kind's schema name
    # (campaign messages answer under "message").
    key, answers = answers if isinstance(answers, tuple) else (answers, answers)
    if answers not in RECORD_SCHEMAS:
        return {"description": "See the contract for this operation."}
    record = {"$ref": f"#/components/schemas/{answers}"}
    one = {"type": "object", "required": [key], "properties": {key: record}}
    if not any(set(allowed) - {"int", "name"} for allowed in route.ids.values()):
        return one
    page = records_answer(key, answers)
    page["required"] = [key, "total", "limit", "offset"]
    return {"oneOf": [one, page]}


def _envelope_schema(success, data):
    return {"type": "object", "required": ["responseId", "version", "success", "data"],
            "properties": {"responseId": {"type": "string"}, "version": {"const": 1},
                           "success": {"const": success}, "data": data}}


def _operation(route):
    levels = f"an API key with the '{route.level}' level" if route.level else "no API key"
    literal = [part for part in route.path.split("/") if part and not part.startswith("{")]
    operation = {
        "operationId": route.method.lower() + re.sub(r"\W+", "_", route.path).rstrip("_"),
        "summary": route.summary or f"{_OPENAPI_VERBS.get(route.method, route.method)} "
                                    f"{' '.join(literal)}",
        "tags": literal[:1],
        "description": f"Needs {levels}. Parameters may come in the query string or in a "
                       "JSON object body (body keys win); unknown ones are refused.",
        "x-access-level": route.level,
        "security": [{"bearer": []}] if route.level else [],
        "parameters": [_id_parameter(name, allowed) for name, allowed in route.ids.items()]
        + [{"name": p.name, "in": "query", "required": False, "schema": _param_schema(p, True)}
           for p in route.params.values() if p.type != "list"],
    }
    if route.params:
        required = [p.name for p in route.params.values() if p.required]
        body = {"type": "object", "additionalProperties": False,
                "properties": {p.name: _param_schema(p) for p in route.params.values()}}
        if required:
            body["required"] = required
        operation["requestBody"] = {
            "required": bool(required),
            "description": "Parameters may come in the query string instead.",
            "content": {"application/json": {"schema": body}}}
    if isinstance(route.answers, dict) and "content" in route.answers:
        success = route.answers
    else:
        success = {"description": "Success: the envelope with the operation's data (a "
                                  "browser gets it as an HTML page).",
                   "content": {"application/json": {"schema": _envelope_schema(
                       True, _success_data(route))}, "text/html": {"schema": {"type": "string"}}}}
    operation["responses"] = {
        "200": success,
        **{str(status): {"$ref": f"#/components/responses/{status}"}
           for status in _route_statuses(route)}}
    return operation


def openapi_document(routes=None, base_url=None):
    """The OpenAPI 3.1 document of the API, as a dict.

    Made from the route table (the one create_app() serves), so it lists every
    route with its placeholders, parameters, level and answers, and cannot
    drift from what the app does.

    :param routes: the route table; ROUTES when None.
    :param base_url: the API's root URL (without ``/v1``) for ``servers``.
    """
    routes = ROUTES if routes is None else routes
    paths = {}
    for route in routes:
        path = "/v1" + Route._PLACEHOLDER.sub(r"{\1}", route.path)
        paths.setdefault(path, {})[route.method.lower()] = _operation(route)
    error_data = {"type": "object", "required": ["error", "message"], "properties": {
        "error": {"type": "string"}, "message": {"type": "string"},
        "field": {"description": "the parameter (or list of them) at fault"},
        "allowed": {"type": "array", "description": "the values or parameters allowed"},
        "checks": {"type": "array", "items": {"type": "object"},
                   "description": "verify's checks, on verification_failed"},
        "rows": {"type": "array", "items": {"type": "object"},
                 "description": "the first rows that fail, on invalid_data"}}}
    responses = {}
    for status, codes in _error_codes().items():
        data = {"allOf": [{"$ref": "#/components/schemas/error"},
                          {"properties": {"error": {"enum": codes}}}]}
        responses[str(status)] = {
            "description": f"{bottle.HTTP_CODES.get(status, 'Error')}: {', '.join(codes)}.",
            "content": {"application/json": {"schema": _envelope_schema(False, data)},
                        "text/html": {"schema": {"type": "string"}}}}
    responses["401"]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    responses["405"]["headers"] = {"Allow": {"schema": {"type": "string"}}}
    document = {
        "openapi": "3.1.0",
        "info": {"title": "campaignapi", "version": __version__,
                 "description": __doc__.split("\n\n")[1].replace("\n", " ") + " Every answer "
                 "is the envelope {responseId, version, success, data}; errors carry "
                 "{error, message} in data and a real HTTP status. A method that a path "
                 "lacks answers 405 method_not_allowed with an Allow header."},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "An API key's secret."}},
            "schemas": {"error": error_data, "envelope": _envelope_schema(True, {}),
                        **RECORD_SCHEMAS},
            "responses": responses,
        },
        "security": [{"bearer": []}],
    }
    if base_url is not None:
        document["servers"] = [{"url": base_url or "/"}]
    return document


def openapi_get(call):
    """The OpenAPI document itself (not in an envelope, so tools can read it)."""
    service = call.service
    if getattr(service, "openapi", None) is None:   # made once per app
        service.openapi = openapi_document()
    document = {**service.openapi, "servers": [{"url": call.base_url or "/"}]}
    return bottle.HTTPResponse(json.dumps(document, ensure_ascii=False), 200, {
        "Content-Type": "application/json", "Access-Control-Allow-Origin": "*"})


_OPENAPI_ANSWER = {"description": "The OpenAPI 3.1 document of this API (no envelope).",
                   "content": {"application/json": {"schema": {"type": "object"}}}}


# ---------------------------------------------------------------------------
# The route table and create_app()
# ---------------------------------------------------------------------------

_PAGE = "limit:int offset:int"
# What create and change of these records share (create makes name required).
_DATASOURCE = "description:text origin:import|signup|api fields:list"
_CAMPAIGN = ("description:text enabled:flag archiveemail:email defaulttemplate:str "
             "thumbnail:str")

def _record_routes(resource, fields):
    """Get (an id or all), Create, Change and soft Delete of a Resource;
    Create and Change take the same ``fields``, all optional."""
    path = f"/{resource.name}/{{id}}"
    return (Route("GET", f"/{resource.name}/{{id:int|all}}", "read", resource.get, _PAGE),
            Route("PUT", path, "create", resource.create, fields),
            Route("POST", path, "write", resource.change, fields),
            Route("DELETE", path, "delete", resource.delete, "id:int"))


#: Every route of the API: (method, path, level, handler, parameters).
ROUTES = [
    # Datasources
    Route("GET", "/datasource/{id:int|all|import}", "read", datasource_get, _PAGE,
          summary="Get datasource (one, all, or the imported ones)", answers="datasource"),
    Route("POST", "/datasource/{id}", "write", datasource_change, "name:str " + _DATASOURCE,
          summary="Change datasource", answers=ANSWER_DONE),
    Route("PUT", "/datasource/{id}", "create", datasource_create, "name:str! " + _DATASOURCE,
          summary="Create datasource", answers=ANSWER_ID),
    Route("DELETE", "/datasource/{id}", "delete", datasource_delete, "id:int!",
          summary="Delete datasource", answers=ANSWER_DONE),

    # Recipients, field changes, imports, exports, organize
    Route("GET", "/datasource/{parent_id}/recipient/{child_id:int|all}", "read", recipient_get,
          _PAGE + " status:active|unsubscribed|bounced"),
    Route("GET", "/datasource/{parent_id}/modify/{child_id:name}", "write", field_modify,
          "new:str! type:" + "|".join(FIELD_TYPES) + "!", writes=True),
    Route("GET", "/datasource/{parent_id}/import/{child_id:int|all}", "read", import_get, _PAGE),
    Route("PUT", "/datasource/{parent_id}/import/{child_id}", "create", import_create,
          "name:str! originalfile:str! __uploadtype__:csv|base64|json! __uploaddata__:data!"),
    Route("POST", "/datasource/{parent_id}/import/{child_id}", "write", import_change,
          "id:int! name:str originalfile:str"),
    Route("DELETE", "/datasource/{parent_id}/import/{child_id}", "delete", import_delete,
          "id:int!"),
    # Not one transaction: _run_export() commits its record around the file.
    Route("GET", "/datasource/{parent_id}/export/{child_id}", "read", export_get, ""),
    Route("GET", "/datasource/{parent_id}/organize/{child_id:int|all}", "read", organize_get,
          _PAGE),
    Route("PUT", "/datasource/{parent_id}/organize/{child_id}", "create", organize_create,
          "item:int! folder:str! sortorder:int!"),
    Route("POST", "/datasource/{parent_id}/organize/{child_id}", "write", organize_change,
          "id:int! folder:str sortorder:int"),

    # Messages, segments, sender profiles
    *_record_routes(MESSAGE, "name:str subject:str fromname:str fromaddress:email "
                             "replyto:email html:text text:text"),
    *_record_routes(SEGMENT, "name:str datasources:list match:all|any conditions:list"),
    *_record_routes(ACCOUNTPROFILE, "name:str fromname:str fromaddress:email replyto:email"),

    # Campaigns
    Route("GET", "/campaign/{id:int|all}", "read", campaign_get, _PAGE,
          summary="Get campaign (one or all)", answers=records_answer("emt_campaign", "campaign")),
    Route("PUT", "/campaign/{id}", "create", CAMPAIGN.create,
          "name:str! accountprofile:int! " + _CAMPAIGN, summary="Create campaign",
          answers=ANSWER_ID),
    Route("POST", "/campaign/{id}", "write", campaign_change,
          "name:str accountprofile:int scheduled:flag " + _CAMPAIGN,
          summary="Change campaign", answers=ANSWER_DONE),
    Route("DELETE", "/campaign/{id}", "delete", campaign_delete, "",
          summary="Delete campaign", answers=ANSWER_DONE),

    # Campaign messages, structure, verify
    Route("GET", "/campaign/{parent_id}/message/{child_id:int|all}", "read",
          campaign_message_get, _PAGE, answers=("message", "campaignmessage")),
    Route("PUT", "/campaign/{parent_id}/message/{child_id}", "create", campaign_message_create,
          "segment:int! message:int! priority:int"),
    Route("POST", "/campaign/{parent_id}/message/{child_id}", "write", campaign_message_change,
          "segmentmessageid:int! segment:int message:int priority:int"),
    Route("DELETE", "/campaign/{parent_id}/message/{child_id}", "write", campaign_message_delete,
          "segmentmessagehack:int!"),
    Route("GET", "/campaign/{parent_id}/structure/{child_id}", "read", campaign_structure_get),
    Route("GET", "/campaign/{parent_id}/verify/{child_id}", "read", campaign_verify_get),

    # Send and archives
    Route("PUT", "/campaign/{parent_id}/send/{child_id}", "create", campaign_send,
          "timestamp:scalar!"),
    Route("GET", "/campaign/{parent_id}/batcharchive/{child_id:int|all}", "read",
          batcharchive_get, _PAGE),
    Route("GET", "/campaign/{parent_id}/archive/{child_id}", "read", archive_get, ""),

    # Public routes (no key): downloads, unsubscribe, the OpenAPI document
    Route("GET", "/openapi.json", None, openapi_get,
          summary="The OpenAPI document of this API", answers=_OPENAPI_ANSWER),
    Route("GET", "/download/{token:name}", None, download, "",
          summary="Download an export's CSV (the link from the export record)",
          answers={"description": "The export as a CSV attachment.",
                   "content": {"text/csv": {"schema": {"type": "string"}}}}),
    Route("GET", "/unsubscribe/{token:name}", None, unsubscribe_page, reads_body=False),
    Route("POST", "/unsubscribe/{token:name}", None, unsubscribe_post, reads_body=False),

]


def create_app(db="campaignapi.db", **config):
    """Build the API as a Bottle app (a WSGI callable) over the database ``db``.

    :param db: path of the SQLite file; created with the schema if new.
    :param config: any key of DEFAULT_CONFIG (max_body, public_url, secret).
    """
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"create_app() got unknown settings: {', '.join(sorted(unknown))}")
    init_db(db)
    service = Service(db, {**DEFAULT_CONFIG, **config})
    app = service.app = bottle.Bottle(catchall=True)
    app.config["campaignapi.service"] = service
    app.default_error_handler = service.bottle_error
    service.routes = list(ROUTES)
    for route in service.routes:
        app.route(route.rule, route.method,
                  callback=lambda _route=route, **ids: service.dispatch(_route, ids),
                  name=f"{route.method} {route.path}")
    # Last, so that every real route matches first.
    for rule in ("/", "/<path:path>"):
        app.route(rule, "ANY", callback=service.no_route, name=f"no route {rule}")
    return app


# ---------------------------------------------------------------------------
# Logging when embedded
# ---------------------------------------------------------------------------

#: The format of the lines that log_to_stderr() and the command line write.
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


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
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
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
def _smtp(text):
    smtp_address(text)
    return text


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


def _check_database(path, *, must_exist):
    """Refuse ``--db`` before anything is created or changed: a directory, a
    missing or unwritable directory, a file that is not a campaignapi database or
    that a newer version made; with ``must_exist``, a path without a database
    (a typo must not start a worker on a new, empty file)."""
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


@contextlib.contextmanager
def _database_errors(path):
    """What is left after _check_database() (a race, a full disk) as one line."""
    try:
        yield
    except (sqlite3.Error, OSError, RuntimeError) as error:
        raise _Refused(f"--db {path}: {error}") from None


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
    _check_database(args.db, must_exist=False)
    sockets, port = _claim_port(args.host, args.port)
    try:
        public_url = args.public_url or f"http://{_url_host(args.host)}:{port}"
        options["public_url"] = public_url
        with _database_errors(args.db):
            secret = _new_account_key(args.db, args.email)
            app = create_app(args.db, public_url=public_url, max_body=args.max_body)
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
                       ident="campaignapi", max_request_body_size=args.max_body + 1)
    except KeyboardInterrupt:
        pass
    except OSError as error:  # only if another process took the port since _claim_port
        raise _Refused(f"cannot listen on {_url_host(args.host)}:{port}: "
                       f"{error.strerror or error}") from None
    finally:
        stop.set()
        worker.join(timeout=60)


def _raise(error):
    raise error


def _stop_on_sigterm(action):
    """SIGTERM (a service manager stopping us) ends the process like Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda signum, frame: action())


def _cmd_worker(args):
    options = _worker_options(args)
    _check_database(args.db, must_exist=True)
    with _database_errors(args.db):
        init_db(args.db)
    stop = threading.Event()
    _stop_on_sigterm(stop.set)
    print(f"campaignapi {__version__} worker on {args.db}, "
          + (f"delivering through {args.smtp}" if args.smtp else "no --smtp: the outbox fills"),
          flush=True)
    try:
        run_worker(args.db, stop, **options)
    except KeyboardInterrupt:
        stop.set()


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
            "mail_from": args.mail_from, "dkim": dkim, "public_url": args.public_url or ""}


def _cmd_key(args):
    _check_database(args.db, must_exist=args.action != "create")
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
    if not argv or argv[0] not in ("serve", "worker", "key", "-h", "--help", "--version"):
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
                       help="the SQLite database; a new one gets the schema, an account and a "
                            "key (default: %(default)s)")
    serve.add_argument("--public-url", default=None, type=_http_url, metavar="URL",
                       help="base URL of the API as the outside world sees it, for links in "
                            "emails (default: http://HOST:PORT)")
    serve.add_argument("--threads", type=_whole_number(1, 1000), default=8, metavar="N",
                       help="waitress threads answering requests, 1 to 1000 "
                            "(default: %(default)s)")
    serve.add_argument("--max-body", type=_whole_number(1, 2**40), metavar="BYTES",
                       default=DEFAULT_CONFIG["max_body"],
                       help="largest request body; waitress answers a larger one with a "
                            "plain-text 413 before reading it (default: %(default)s, 64 MiB)")
    # A reserved domain (RFC 2606): notifications go nowhere until the holder
    # starts the first time with --email, which is what a real install does.
    serve.add_argument("--email", default="admin@example.com", type=_address, metavar="ADDR",
                       help="account address used when the database is new, where import "
                            "and export notifications go (default: %(default)s)")
    _add_delivery_options(serve)
    serve.set_defaults(func=_cmd_serve)

    worker = commands.add_parser("worker", help="make due batches and deliver the outbox, alone")
    worker.add_argument("--db", default="campaignapi.db", metavar="PATH",
                        help="the database; it must exist (default: %(default)s)")
    worker.add_argument("--public-url", default=None, type=_http_url, metavar="URL",
                        help="base URL of unsubscribe links when a batch has none "
                             "(default: none)")
    _add_delivery_options(worker)
    worker.set_defaults(func=_cmd_worker)

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
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        args.func(args)
    except _Refused as refusal:
        command = " ".join(filter(None, (args.command, getattr(args, "action", None))))
        print(f"campaignapi {command}: error: {' '.join(str(refusal).split())}",
              file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
