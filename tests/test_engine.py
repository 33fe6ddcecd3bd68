"""The engine layer on both engines: connect(), the sqlite3 subset the module
uses, transaction(), INTEGRITY_ERRORS, the SQL spellings, init_db."""

import datetime
import json
import os
import subprocess
import sys
import threading

import pytest

import campaignapi
from helpers import later

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def conn(engine_db):
    campaignapi.init_db(engine_db)
    conn = campaignapi.connect(engine_db)
    yield conn
    conn.close()


def _account(conn, email="a@example.com", **columns):
    names = ", ".join(["email", *columns])
    marks = ", ".join("?" for _ in range(1 + len(columns)))
    return conn.execute(f"INSERT INTO account ({names}) VALUES ({marks})",
                        (email, *columns.values())).lastrowid


def test_connect_names_its_engine(engine_db, request):
    conn = campaignapi.connect(engine_db)
    try:
        engine = request.node.callspec.params["engine_db"]
        assert conn.engine == engine
        # internal: the engines' own SQL spellings
        assert conn.sql is campaignapi._SQL[engine]
    finally:
        conn.close()


def test_placeholders_plain_numbered_and_literal(conn):
    row = conn.execute("SELECT ?, ?, ?", (1, "two", None)).fetchone()
    assert tuple(row) == (1, "two", None)
    # ?NNN picks a value by number and may repeat; a bare ? then takes the next.
    row = conn.execute("SELECT ?2, ?1, ?2, ?", ("a", "b", "c")).fetchone()
    assert tuple(row) == ("b", "a", "b", "c")
    # A '?' or '%' inside a literal, a quoted name or a comment is text.
    row = conn.execute("SELECT '?%' AS \"q?%\", ? -- what? 100%\n, '50%' || ?",
                       ("x%s", "%d")).fetchone()
    assert tuple(row) == ("?%", "x%s", "50%%d")
    assert row.keys()[0] == "q?%"
    assert conn.execute("SELECT '%'").fetchone()[0] == "%"


def test_rows_as_sqlite3_row(conn):
    _account(conn, "Row@Example.com")
    row = conn.execute("SELECT id, email AS Address FROM account").fetchone()
    assert row["id"] == row[0] == 1
    assert row["Address"] == row["address"] == row["ADDRESS"] == row[1] == "Row@Example.com"
    assert row.keys() == ["id", "address"] or row.keys() == ["id", "Address"]
    assert dict(row) == {row.keys()[0]: 1, row.keys()[1]: "Row@Example.com"}
    identifier, address = row
    assert (identifier, address) == (1, "Row@Example.com") and len(row) == 2
    assert tuple(row[0:2]) == (1, "Row@Example.com")
    with pytest.raises(IndexError):
        row["missing"]
    assert [tuple(r) for r in conn.execute("SELECT id FROM account")] == [(1,)]
    assert [tuple(r) for r in conn.execute("SELECT id FROM account").fetchall()] == [(1,)]


def test_cursor_without_row_factory_gives_tuples(conn):
    _account(conn)
    cursor = conn.cursor()
    cursor.row_factory = None
    try:
        assert list(cursor.execute("SELECT id, email FROM account")) == [(1, "a@example.com")]
    finally:
        cursor.close()


def test_lastrowid_and_explicit_ids(conn):
    first = _account(conn, "one@example.com")
    assert first == 1
    # Create at a chosen id: taken as given, and the next new id comes after it.
    assert _account(conn, "chosen@example.com", id=40) == 40
    assert _account(conn, "next@example.com") == 41
    # A lower free id is taken as given and does not move the next one back.
    assert _account(conn, "low@example.com", id=7) == 7
    assert _account(conn, "after@example.com") == 42
    # Several rows in one INSERT: the last one's id, as in SQLite.
    assert conn.execute("INSERT INTO account (email) VALUES (?), (?)",
                        ("x@example.com", "y@example.com")).lastrowid == 44


def test_rowcount_and_executemany(conn):
    account = _account(conn)
    ds = conn.execute("INSERT INTO datasource (owner, name) VALUES (?, 'list')",
                      (account,)).lastrowid
    conn.executemany("INSERT INTO recipient (datasource, email) VALUES (?, ?)",
                     [(ds, f"r{i}@example.com") for i in range(5)])
    assert conn.execute("SELECT count(*) FROM recipient").fetchone()[0] == 5
    assert conn.execute("UPDATE recipient SET status = 'bounced' WHERE id > ?",
                        (3,)).rowcount == 2
    assert conn.execute("DELETE FROM recipient WHERE status = ?", ("bounced",)).rowcount == 2


def test_bool_parameters_store_as_integers(conn):
    account = _account(conn)
    conn.execute("INSERT INTO apikey (account, levels, hash, revoked) VALUES (?, 'read', 'h', ?)",
                 (account, True))
    assert conn.execute("SELECT revoked FROM apikey WHERE revoked = ?",
                        (True,)).fetchone()[0] == 1


def test_transaction_commits_and_rolls_back(conn):
    with campaignapi.transaction(conn):
        assert conn.in_transaction
        _account(conn, "kept@example.com")
    assert not conn.in_transaction
    with pytest.raises(RuntimeError):
        with campaignapi.transaction(conn):
            _account(conn, "lost@example.com")
            raise RuntimeError("boom")
    assert not conn.in_transaction
    emails = [row[0] for row in conn.execute("SELECT email FROM account ORDER BY id")]
    assert emails == ["kept@example.com"]


def test_a_transactions_first_and_last_statements_go_with_begin_and_commit(conn):
    # transaction(first=...) gives the first statement's cursor; what the
    # block leaves in conn.at_commit runs before the COMMIT, in it (on
    # PostgreSQL each pair is one round trip, its values written in as
    # literals: quotes, a percent sign and a question mark stay text).
    odd = "it's 100% ?ok"
    with campaignapi.transaction(conn, first=(
            "SELECT count(*) AS n, ? AS odd FROM account WHERE email = ?", (odd, odd))) as first:
        row = first.fetchone()
        assert (row["n"], row["odd"]) == (0, odd)
        _account(conn, "kept@example.com")
        conn.at_commit = [("UPDATE account SET email = ? WHERE email = ?",
                           (odd + "@example.com", "kept@example.com"))]
    assert not conn.in_transaction and not conn.at_commit
    assert [row[0] for row in conn.execute("SELECT email FROM account")] == [odd + "@example.com"]
    # A last statement that fails rolls the whole transaction back.
    with pytest.raises(campaignapi.INTEGRITY_ERRORS):
        with campaignapi.transaction(conn, first=("SELECT 1", ())):
            _account(conn, "lost@example.com")
            conn.at_commit = [("INSERT INTO account (email) VALUES (?)", (None,))]
    assert not conn.in_transaction and not conn.at_commit
    assert [row[0] for row in conn.execute("SELECT email FROM account")] == [odd + "@example.com"]
    # A first statement that fails leaves no transaction open.
    with pytest.raises(campaignapi.INTEGRITY_ERRORS):
        with campaignapi.transaction(conn, first=("INSERT INTO account (email) VALUES (?)",
                                                  (None,))):
            pass
    assert not conn.in_transaction
    assert conn.execute("SELECT count(*) FROM account").fetchone()[0] == 1


def test_nested_transaction_is_a_savepoint(conn):
    with campaignapi.transaction(conn):
        _account(conn, "outer@example.com")
        with pytest.raises(campaignapi.INTEGRITY_ERRORS):
            with campaignapi.transaction(conn):
                _account(conn, "inner@example.com")
                _account(conn, "OUTER@example.com")   # NOCASE: a duplicate
        with campaignapi.transaction(conn):
            _account(conn, "second@example.com")
    emails = [row[0] for row in conn.execute("SELECT email FROM account ORDER BY id")]
    assert emails == ["outer@example.com", "second@example.com"]


@pytest.mark.parametrize("sql, params", [
    ("INSERT INTO account (email) VALUES (?)", ("Taken@Example.com",)),         # UNIQUE NOCASE
    ("INSERT INTO datasource (owner, name) VALUES (?, 'x')", (999,)),          # FOREIGN KEY
    ("INSERT INTO apikey (account, levels, hash, revoked) VALUES (1, 'r', 'h', ?)", (2,)),  # CHECK
    ("INSERT INTO account (email) VALUES (?)", (None,)),                       # NOT NULL
])
def test_integrity_errors(conn, sql, params):
    _account(conn, "taken@example.com")
    with pytest.raises(campaignapi.INTEGRITY_ERRORS):
        conn.execute(sql, params)
    # The connection goes on working after the error.
    assert conn.execute("SELECT count(*) FROM account").fetchone()[0] == 1


def test_commit_after_a_swallowed_error_is_never_reported_done(conn):
    """On PostgreSQL an error aborts the whole transaction; a COMMIT after a
    caught error is a rollback there, and must not pass as a commit."""
    if conn.engine == "sqlite":
        with campaignapi.transaction(conn):
            _account(conn, "a@example.com")
            with pytest.raises(campaignapi.INTEGRITY_ERRORS):
                _account(conn, "a@example.com")
        assert conn.execute("SELECT count(*) FROM account").fetchone()[0] == 1
        return
    import psycopg

    with pytest.raises(psycopg.Error, match="rolled back"):
        with campaignapi.transaction(conn):
            _account(conn, "a@example.com")
            with pytest.raises(campaignapi.INTEGRITY_ERRORS):
                _account(conn, "a@example.com")
    assert not conn.in_transaction
    assert conn.execute("SELECT count(*) FROM account").fetchone()[0] == 0


def test_temp_tables(conn):
    temp = conn.sql["temp"]
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS scratch (id INTEGER PRIMARY KEY)")
    conn.executemany(f"INSERT INTO {temp}.scratch (id) VALUES (?)", [(1,), (2,)])
    assert conn.execute(f"SELECT count(*) FROM {temp}.scratch").fetchone()[0] == 2


def _one(conn, expression, params=()):
    return conn.execute(f"SELECT {expression}", params).fetchone()[0]


def test_spellings_mean_the_same_on_both_engines(conn):
    sql = conn.sql
    assert _one(conn, sql["contains"].format(haystack="lower(?)", needle="?"), ("Hello", "ell"))
    assert not _one(conn, sql["contains"].format(haystack="?", needle="?"), ("Hello", "x"))
    assert _one(conn, "{} = ?".format(sql["nocase"].format(expr="?")), ("ABC", "abc"))
    # NOCASE folds ASCII only (the test cluster runs with the C ctype).
    assert not _one(conn, "{} = ?".format(sql["nocase"].format(expr="?")), ("Ä", "ä"))
    stamp = "%Y-%m-%d %H:%M:%S"
    now = datetime.datetime.strptime(_one(conn, sql["now"]), stamp)   # UTC, our format
    assert abs(now - datetime.datetime.strptime(later(), stamp)).total_seconds() < 5
    data = json.dumps({"3": "Text", "4": 12, "5": 2.5})
    assert _one(conn, sql["json_value"].format(json="?", key=3), (data,)) == "Text"
    assert float(_one(conn, sql["json_number"].format(json="?", key=4), (data,))) == 12
    assert _one(conn, sql["json_number"].format(json="?", key=3), (data,)) in (None, "Text")
    assert _one(conn, sql["json_value"].format(json="?", key=9), (data,)) is None
    changed = _one(conn, sql["json_set"].format(json="?", key=4, value="?"), (data, "13"))
    assert json.loads(changed) == {"3": "Text", "4": 13, "5": 2.5}
    merged = _one(conn, sql["json_merge"].format(json="?", patch="?"),
                  (data, json.dumps({"3": None, "6": "new"})))
    assert json.loads(merged) == {"4": 12, "5": 2.5, "6": "new"}
    _account(conn, "a@example.com")
    _account(conn, "b@example.com")
    ids = conn.execute("SELECT email FROM account WHERE id IN ({}) ORDER BY id".format(
        sql["json_ids"].format(array="?")), (json.dumps([2, 9]),)).fetchall()
    assert [row[0] for row in ids] == ["b@example.com"]
    found = conn.execute("SELECT id FROM account WHERE email IN ({}) ORDER BY id".format(
        sql["json_addresses"].format(array="?")), (json.dumps(["A@EXAMPLE.com"]),)).fetchall()
    assert [row[0] for row in found] == [1]
    joined = _one(conn, "{} FROM account".format(sql["group_concat"].format(expr="email",
                                                                           sep="','")))
    assert sorted(joined.split(",")) == ["a@example.com", "b@example.com"]


def test_row_locks(engine_db, conn):
    """A claim's SELECT takes the rows no other transaction holds; on SQLite
    the whole database is the lock (BEGIN IMMEDIATE), so the spellings are
    empty there."""
    for email in ("a@example.com", "b@example.com"):
        _account(conn, email)
    claim = "SELECT id FROM account ORDER BY id LIMIT 1 " + conn.sql["skip_locked"]
    with campaignapi.transaction(conn):
        assert conn.execute(claim).fetchone()[0] == 1
        assert conn.execute("SELECT id FROM account WHERE id = 2 "
                            + conn.sql["for_update"]).fetchone()[0] == 2
        if conn.engine == "postgresql":
            other = campaignapi.connect(engine_db)
            try:
                with campaignapi.transaction(other):
                    assert other.execute(claim).fetchall() == []   # both rows held
            finally:
                other.close()


def test_portable_spellings(conn):
    """The spellings written once for both engines (see the SQL table's comment)."""
    assert _one(conn, "? IS NOT DISTINCT FROM ?", (None, None))
    assert not _one(conn, "? IS DISTINCT FROM ?", ("a", "a"))
    account = _account(conn)
    conn.execute("INSERT INTO setting (name, value) VALUES ('k', 'v') ON CONFLICT DO NOTHING")
    conn.execute("INSERT INTO setting (name, value) VALUES ('k', 'w') ON CONFLICT DO NOTHING")
    assert _one(conn, "value FROM setting WHERE name = 'k'") == "v"
    conn.execute("INSERT INTO message (owner, name) VALUES (?, 'a'), (?, 'b'), (?, 'b')",
                 (account,) * 3)
    row = conn.execute("SELECT count(*), count(*) FILTER (WHERE name = 'b') FROM message "
                       "WHERE (1 = 1)").fetchone()
    assert tuple(row) == (3, 2)
    assert _one(conn, "count(*) FROM (WITH m AS MATERIALIZED (SELECT name FROM message) "
                      "SELECT * FROM m a JOIN m b ON a.name = b.name) AS pairs") == 5


def test_init_db_twice_at_once(engine_db):
    """Processes that start together take turns making the schema."""
    errors = []

    def start():
        try:
            campaignapi.init_db(engine_db)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    conn = campaignapi.connect(engine_db)
    try:
        assert conn.schema_version() == campaignapi.SCHEMA_VERSION
    finally:
        conn.close()


def test_a_newer_database_is_refused(engine_db):
    campaignapi.init_db(engine_db)
    conn = campaignapi.connect(engine_db)
    try:
        conn.set_schema_version(campaignapi.SCHEMA_VERSION + 1)
    finally:
        conn.close()
    with pytest.raises(RuntimeError, match="schema version"):
        campaignapi.init_db(engine_db)


def _python(code):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=60)


def test_import_does_not_import_psycopg():
    result = _python("import sys, campaignapi; print('psycopg' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_postgresql_without_psycopg_is_one_clear_error(tmp_path):
    # None in sys.modules makes every import of psycopg fail, as if not installed.
    code = (
        "import sys\n"
        "sys.modules['psycopg'] = None\n"
        "import campaignapi\n"
        f"campaignapi.create_app({str(tmp_path / 'ok.db')!r})\n"
        "for call in (campaignapi.connect, campaignapi.create_app):\n"
        "    try:\n"
        "        call('postgresql://127.0.0.1:1/none')\n"
        "    except RuntimeError as error:\n"
        "        print(error)\n")
    result = _python(code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert "psycopg" in line and "pip install 'campaignapi[postgres]'" in line
