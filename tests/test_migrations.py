"""Versioned schema: a database made by an older schema opens with this code
and keeps every row, on both engines (README: engines)."""

import os
import re

import pytest
import webtest

import campaignapi

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "schemas", "v1.sql"), encoding="utf-8") as _file:
    V1 = _file.read()

SECRET = "cak_migration-test-secret"
T = "2024-01-02 03:04:05"

# One or more rows in every table of version 1, with every column given.
V1_ROWS = [
    ("setting", {"name": "secret", "value": "00ab" * 16}),
    ("account", {"id": 1, "email": "Owner@Example.com", "created": T}),
    ("account", {"id": 2, "email": "other@example.org", "created": T}),
    ("apikey", {"id": 1, "account": 1, "name": "ci", "levels": "read,write,create,delete",
                # internal: a version-1 key row written by hand needs its stored hash
                "hash": campaignapi._hash_secret(SECRET), "created": T, "expires": None,
                "revoked": 0}),
    ("suppression", {"account": 1, "email": "Gone@Example.com", "reason": "unsubscribed",
                     "campaign": 1, "created": T}),
    ("datasource", {"id": 1, "owner": 1, "name": "Customers", "description": "all of them",
                    "origin": "import", "created": T, "deleted": 0}),
    ("field", {"id": 1, "datasource": 1, "name": "email", "type": "email"}),
    ("field", {"id": 2, "datasource": 1, "name": "Name", "type": "text"}),
    ("field", {"id": 3, "datasource": 1, "name": "age", "type": "integer"}),
    ("import", {"id": 1, "datasource": 1, "name": "first", "originalfile": "people.csv",
                "uploadtype": "csv", "status": "finished", "rows": 3, "inserted": 2,
                "updated": 0, "skipped": 1, "errors": '[{"row": "3", "error": "bad address"}]',
                "created": T, "finished": T}),
    ("recipient", {"id": 1, "datasource": 1, "email": "Ann@Example.com",
                   "data": '{"2": "Ann", "3": 41}', "status": "active", "import": 1,
                   "created": T, "updated": T}),
    ("recipient", {"id": 2, "datasource": 1, "email": "gone@example.com", "data": "{}",
                   "status": "unsubscribed", "import": 1, "created": T, "updated": T}),
    ("export", {"id": 1, "datasource": 1, "status": "finished", "rows": 1, "token": "tok",
                "path": "/tmp/export-1.csv", "expires": T, "created": T, "finished": T}),
    ("organize", {"id": 1, "item": 1, "folder": "clients", "sortorder": 2}),
    ("message", {"id": 1, "owner": 1, "name": "news", "subject": "Hello {{name}}",
                 "fromname": "Me", "fromaddress": "me@example.com", "replyto": "",
                 "html": "<p>Hi 100%</p>", "text": "Hi", "created": T, "deleted": 0}),
    ("segment", {"id": 1, "owner": 1, "name": "adults", "datasources": "[1]", "match": "all",
                 "conditions": '[{"field": "age", "op": "gt", "value": "17"}]', "created": T,
                 "deleted": 0}),
    ("accountprofile", {"id": 1, "owner": 1, "name": "main", "fromname": "Me",
                        "fromaddress": "me@example.com", "replyto": "r@example.com",
                        "created": T, "deleted": 0}),
    ("campaign", {"id": 1, "owner": 1, "accountprofile": 1, "name": "Spring",
                  "description": "d", "enabled": 1, "archiveemail": "archive@example.com",
                  "defaulttemplate": "", "thumbnail": None, "created": T, "deleted": 0}),
    ("campaign_message", {"id": 1, "campaign": 1, "segment": 1, "message": 1, "priority": 0}),
    ("batch", {"id": 1, "campaign": 1, "timestamp": T, "status": "sending",
               "base_url": "https://example.com/email", "recipients": 1, "created": T,
               "finished": None}),
    ("batch_message", {"batch": 1, "message": 1, "subject": "Hello {{name}}",
                       "html": "<p>Hi</p>", "text": "Hi"}),
    ("outbox", {"id": 1, "account": 1, "kind": "campaign", "batch": 1, "message": 1,
                "recipient": 1, "to_addr": "Ann@Example.com", "subject": None, "body": None,
                "html": None, "status": "sent", "attempts": 1, "next_try": T,
                "claimed_by": None, "claimed_at": None, "attempt_started": None,
                "error": None, "created": T, "sent": T}),
    ("outbox", {"id": 2, "account": 1, "kind": "notification", "batch": None, "message": None,
                "recipient": None, "to_addr": "owner@example.com", "subject": "Done",
                "body": "Your import finished.", "html": None, "status": "queued",
                "attempts": 0, "next_try": T, "claimed_by": "host:1", "claimed_at": T,
                "attempt_started": None, "error": "451 later", "created": T, "sent": None}),
]


def _insert_rows(conn, rows):
    for table, values in rows:
        conn.execute(f"INSERT INTO {table} ({', '.join(values)}) "
                     f"VALUES ({', '.join('?' for _ in values)})", tuple(values.values()))


def make_database(db, script, version, rows=V1_ROWS):
    """A database as the code of schema ``version`` (``script``) left it, with rows."""
    conn = campaignapi.connect(db)
    try:
        with conn.schema_change():
            conn.run_script(conn.schema_script(script))
            conn.set_schema_version(version)
            _insert_rows(conn, rows)
    finally:
        conn.close()


def _tables(conn):
    if conn.engine == "sqlite":
        sql = "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
    else:
        sql = ("SELECT table_name FROM information_schema.tables WHERE table_schema = "
               "'public' AND table_name != 'campaignapi_schema' ORDER BY table_name")
    return [row[0] for row in conn.execute(sql)]


def snapshot(db):
    """{table: sorted rows as {column: value}} of every table."""
    conn = campaignapi.connect(db)
    try:
        return {table: sorted((dict(row) for row in conn.execute(f"SELECT * FROM {table}")),
                              key=repr)
                for table in _tables(conn)}
    finally:
        conn.close()


def describe(db):
    """The schema as the engine reports it, for comparing two databases."""
    conn = campaignapi.connect(db)
    try:
        if conn.engine == "sqlite":
            def normal(sql):
                sql = re.sub(r"--[^\n]*", "", sql).replace('"', "")
                sql = re.sub(r"\s+", " ", sql.replace("IF NOT EXISTS ", ""))
                return re.sub(r" ?([(),]) ?", r"\1", sql).strip()
            return sorted((row[0], row[1], normal(row[2])) for row in conn.execute(
                "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL"))
        parts = [tuple(row) for row in conn.execute(
            "SELECT table_name, column_name, data_type, is_nullable, column_default "
            "FROM information_schema.columns WHERE table_schema = 'public' "
            "ORDER BY table_name, ordinal_position")]
        parts += sorted(tuple(row) for row in conn.execute(
            "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) "
            "FROM pg_constraint WHERE connamespace = 'public'::regnamespace"))
        parts += sorted(tuple(row) for row in conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'"))
        parts += sorted(tuple(row) for row in conn.execute(
            "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE NOT tgisinternal"))
        parts += sorted(tuple(row) for row in conn.execute(
            "SELECT proname, prosrc FROM pg_proc WHERE pronamespace = 'public'::regnamespace"))
        return parts
    finally:
        conn.close()


def test_every_v1_table_has_rows_in_the_test(engine_db):
    make_database(engine_db, V1, 1)
    tables = snapshot(engine_db)
    assert sorted(tables) == sorted({table for table, _ in V1_ROWS})
    assert all(tables.values()), [name for name, rows in tables.items() if not rows]


def test_a_v1_database_opens_and_keeps_every_row(engine_db, same_engine_db):
    make_database(engine_db, V1, 1)
    before = snapshot(engine_db)
    app = campaignapi.create_app(engine_db)     # runs init_db: the migrations
    after = snapshot(engine_db)
    # Every row is kept with every value; columns that later versions add
    # hold their defaults.
    assert {table: [{column: row[column] for column in rows[0]} for row in after[table]]
            if rows else after[table] for table, rows in before.items()} == before
    conn = campaignapi.connect(engine_db)
    try:
        assert conn.schema_version() == campaignapi.SCHEMA_VERSION
    finally:
        conn.close()
    # The upgraded database has the schema a new one gets, so a schema.sql
    # change without its migration step fails here.
    fresh = same_engine_db
    campaignapi.init_db(fresh)
    assert describe(engine_db) == describe(fresh)
    # Version 10 finds the lists each batch mailed in the outbox, for the
    # public archives: batch 1 mailed a recipient of datasource 1.
    assert after["batch_datasource"] == [{"datasource": 1, "batch": 1}]
    if engine_db.startswith("postgresql://"):
        return  # the requests below run on PostgreSQL after the handlers' port (issue 12)
    client = webtest.TestApp(app)
    headers = {"Authorization": f"Bearer {SECRET}"}
    campaigns = client.get("/v1/campaign/all", headers=headers).json["data"]
    assert [c["name"] for c in campaigns["emt_campaign"]] == ["Spring"]


# The machinery, with steps made up for the test: a column added (version 2)
# and a CHECK changed (version 3), the change SQLite's ALTER TABLE cannot make.
IMPORT_V1 = re.search(r"CREATE TABLE IF NOT EXISTS import \(.*?\n\);", V1, re.S)[0]
IMPORT_V3 = IMPORT_V1.replace("('csv', 'base64', 'json')", "('csv', 'base64', 'json', 'xlsx')")
CAMPAIGN_V1 = re.search(r"CREATE TABLE IF NOT EXISTS campaign \(.*?\n\);", V1, re.S)[0]
CAMPAIGN_V3 = CAMPAIGN_V1.replace(
    "    deleted         INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1))\n",
    "    deleted         INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1)),\n"
    "    note            TEXT NOT NULL DEFAULT ''\n")
V3 = V1.replace(IMPORT_V1, IMPORT_V3).replace(CAMPAIGN_V1, CAMPAIGN_V3)
STEPS = (
    (2, "ALTER TABLE campaign ADD COLUMN note TEXT NOT NULL DEFAULT ''"),
    # internal: the migration machinery itself, run on made-up steps
    (3, {"sqlite": lambda conn: campaignapi._rebuild_table(conn, "import", IMPORT_V3),
         "postgresql": "ALTER TABLE import DROP CONSTRAINT import_uploadtype_check, "
                       "ADD CONSTRAINT import_uploadtype_check "
                       "CHECK (uploadtype IN ('csv', 'base64', 'json', 'xlsx'));"}),
)


def _upgrade(db, target, steps, script=V3):
    conn = campaignapi.connect(db)
    try:
        with conn.schema_change():
            # internal: the migration machinery itself, run on made-up steps
            campaignapi._migrate(conn, script, target, steps)
    finally:
        conn.close()


def test_steps_run_in_order_and_keep_every_row(engine_db, same_engine_db):
    assert V3 != V1 and IMPORT_V3 != IMPORT_V1 and CAMPAIGN_V3 != CAMPAIGN_V1
    make_database(engine_db, V1, 1)
    before = snapshot(engine_db)
    _upgrade(engine_db, 3, STEPS)
    after = snapshot(engine_db)
    assert [row.pop("note") for row in after["campaign"]] == [""]
    assert after == before   # recipient.import kept: the rebuild dropped no reference
    conn = campaignapi.connect(engine_db)
    try:
        assert conn.schema_version() == 3
        conn.execute("INSERT INTO import (datasource, uploadtype) VALUES (1, 'xlsx')")
        with pytest.raises(campaignapi.INTEGRITY_ERRORS):
            conn.execute("INSERT INTO import (datasource, uploadtype) VALUES (1, 'pdf')")
        with pytest.raises(campaignapi.INTEGRITY_ERRORS):   # foreign keys still enforced
            conn.execute("INSERT INTO import (datasource, uploadtype) VALUES (9, 'csv')")
    finally:
        conn.close()
    fresh = same_engine_db
    make_database(fresh, V3, 3, rows=[])
    assert describe(engine_db) == describe(fresh)


def test_a_failing_step_changes_nothing(engine_db):
    make_database(engine_db, V1, 1)
    before, schema = snapshot(engine_db), describe(engine_db)

    def broken(conn):
        conn.execute("UPDATE recipient SET status = 'bounced'")
        raise RuntimeError("step 3 is broken")

    with pytest.raises(RuntimeError, match="step 3 is broken"):
        _upgrade(engine_db, 3, (STEPS[0], (3, broken)))
    assert snapshot(engine_db) == before and describe(engine_db) == schema
    conn = campaignapi.connect(engine_db)
    try:
        assert conn.schema_version() == 1
    finally:
        conn.close()


def test_a_step_that_breaks_a_reference_is_refused_on_sqlite(tmp_path):
    """SQLite checks the foreign keys at the end of the schema change (their
    enforcement is off meanwhile, for the table rebuilds)."""
    db = str(tmp_path / "v1.db")
    make_database(db, V1, 1)
    before = snapshot(db)

    def orphan(conn):
        conn.execute("DELETE FROM datasource")

    with pytest.raises(RuntimeError, match="foreign keys"):
        _upgrade(db, 2, ((2, orphan),), script=V1)
    assert snapshot(db) == before
