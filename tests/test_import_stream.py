"""recipient.datasource and recipient.import on PostgreSQL (issue 19): checked
once a statement by triggers instead of foreign keys, which must behave as
the foreign keys did (the cases that name the engine run on both: the
behaviour is the same on SQLite); the id trigger once a statement too."""

import pytest

import campaignapi
from conftest import TEST_ENGINE
from helpers import database, scalar


on_postgresql = pytest.mark.skipif(TEST_ENGINE != "postgresql",
                                   reason="the COPY paths and triggers of PostgreSQL")


def _fk_error(error, message, detail):
    """``error`` is PostgreSQL's foreign key error, word for word."""
    assert isinstance(error, campaignapi.INTEGRITY_ERRORS) and error.sqlstate == "23503"
    assert (error.diag.message_primary, error.diag.message_detail) == (message, detail)


def _world(conn):
    """Two datasources: the first with an import and recipients of it and not,
    the second with one recipient only (nothing else names it)."""
    conn.execute("INSERT INTO account (id, email) VALUES (1, 'o@example.com')")
    conn.executemany("INSERT INTO datasource (id, owner, name) VALUES (?, 1, ?)",
                     [(1, "one"), (2, "two")])
    conn.execute("INSERT INTO import (id, datasource, uploadtype) VALUES (7, 1, 'csv')")
    conn.executemany("INSERT INTO recipient (datasource, email, import) VALUES (?, ?, ?)",
                     [(1, "a@example.com", 7), (1, "b@example.com", 7),
                      (1, "c@example.com", None), (2, "d@example.com", None)])


def _refused(conn, sql, constraint):
    with pytest.raises(campaignapi.INTEGRITY_ERRORS) as excinfo:
        with campaignapi.transaction(conn):
            conn.execute(sql)
    if conn.engine == "postgresql":
        assert excinfo.value.sqlstate == "23503"
        assert excinfo.value.diag.constraint_name == constraint
    return excinfo.value


def test_foreign_keys_of_recipient_behave_alike_on_both_engines(engine_db):
    campaignapi.init_db(engine_db)
    with database(engine_db) as conn:
        with campaignapi.transaction(conn):
            _world(conn)
        # A recipient naming no datasource or no import is refused, by insert
        # or by update.
        _refused(conn, "INSERT INTO recipient (datasource, email) VALUES (3, 'x@example.com')",
                 "recipient_datasource_fkey")
        _refused(conn, "INSERT INTO recipient (datasource, email, import) "
                       "VALUES (1, 'x@example.com', 8)", "recipient_import_fkey")
        _refused(conn, "UPDATE recipient SET datasource = 3 WHERE email = 'a@example.com'",
                 "recipient_datasource_fkey")
        _refused(conn, "UPDATE recipient SET import = 8 WHERE email = 'c@example.com'",
                 "recipient_import_fkey")
        # ON DELETE NO ACTION: a datasource with recipients stays, nor may its
        # id change under them; without them, it goes.
        error = _refused(conn, "DELETE FROM datasource WHERE id = 2", "recipient_datasource_fkey")
        if conn.engine == "postgresql":
            _fk_error(error, 'update or delete on table "datasource" violates foreign key '
                             'constraint "recipient_datasource_fkey" on table "recipient"',
                      'Key (id)=(2) is still referenced from table "recipient".')
        _refused(conn, "UPDATE datasource SET id = 5 WHERE id = 2", "recipient_datasource_fkey")
        with campaignapi.transaction(conn):
            conn.execute("UPDATE datasource SET name = 'renamed' WHERE id = 2")
            conn.execute("DELETE FROM recipient WHERE datasource = 2")
            conn.execute("DELETE FROM datasource WHERE id = 2")
        # ON DELETE SET NULL: the import goes, its recipients stay with no import.
        with campaignapi.transaction(conn):
            conn.execute("DELETE FROM import WHERE id = 7")
        assert sorted(tuple(row) for row in conn.execute(
            "SELECT email, import FROM recipient")) == [
            ("a@example.com", None), ("b@example.com", None), ("c@example.com", None)]
        assert [row[0] for row in conn.execute("SELECT id FROM datasource")] == [1]


@on_postgresql
def test_ids_given_explicitly_move_the_sequence_past_them(db):
    with database(db) as conn:
        with campaignapi.transaction(conn):
            conn.execute("INSERT INTO account (id, email) VALUES (1, 'o@example.com')")
            conn.execute("INSERT INTO datasource (id, owner, name) VALUES (40, 1, 'chosen')")
            conn.executemany("INSERT INTO datasource (owner, name) VALUES (1, ?)",
                             [("next",), ("after",)])
            # Several at once, one of them past the sequence: one statement.
            conn.execute("INSERT INTO datasource (id, owner, name) "
                         "VALUES (50, 1, 'a'), (90, 1, 'b'), (52, 1, 'c')")
            conn.execute("INSERT INTO datasource (owner, name) VALUES (1, 'last')")
        assert [tuple(row) for row in conn.execute(
            "SELECT id, name FROM datasource ORDER BY id")] == [
            (40, "chosen"), (41, "next"), (42, "after"), (50, "a"), (52, "c"), (90, "b"),
            (91, "last")]


#: What the code of schema version 2 made on PostgreSQL that version 3 no longer has.
V2_POSTGRESQL = """
DROP TRIGGER recipient_datasource_fkey_insert ON recipient;
DROP TRIGGER recipient_datasource_fkey_update ON recipient;
DROP TRIGGER recipient_datasource_fkey_parent_delete ON datasource;
DROP TRIGGER recipient_datasource_fkey_parent_update ON datasource;
DROP TRIGGER recipient_import_fkey_insert ON recipient;
DROP TRIGGER recipient_import_fkey_update ON recipient;
DROP TRIGGER recipient_import_fkey_parent_delete ON import;
DROP TRIGGER recipient_import_fkey_parent_update ON import;
ALTER TABLE recipient ADD FOREIGN KEY (datasource) REFERENCES datasource(id);
ALTER TABLE recipient ADD FOREIGN KEY (import) REFERENCES import(id) ON DELETE SET NULL;
DROP INDEX recipient_import;
CREATE INDEX recipient_import ON recipient(import);
CREATE FUNCTION campaignapi_id_past() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id > coalesce(pg_sequence_last_value(TG_ARGV[0]::regclass), 0) THEN
        PERFORM setval(TG_ARGV[0]::regclass, NEW.id);
    END IF;
    RETURN NEW;
END $$;
"""


@on_postgresql
def test_a_version_2_database_gets_the_schema_of_a_new_one(pg_db, request):
    from test_migrations import describe

    campaignapi.init_db(pg_db)
    with database(pg_db) as conn:
        with campaignapi.transaction(conn):
            tables = sorted(campaignapi._pg_id_tables())
            conn.run_script(V2_POSTGRESQL + "".join(
                f"DROP TRIGGER {table}_id_past ON {table}; "
                f"CREATE TRIGGER {table}_id_past BEFORE INSERT ON {table} FOR EACH ROW "
                f"EXECUTE FUNCTION campaignapi_id_past('{table}_id_seq');" for table in tables))
            conn.set_schema_version(2)
            _world(conn)
    assert scalar(pg_db, "SELECT count(*) FROM pg_constraint WHERE conname IN "
                         "('recipient_datasource_fkey', 'recipient_import_fkey')") == 2
    campaignapi.init_db(pg_db)
    with request.getfixturevalue("pg_cluster").database() as fresh:
        campaignapi.init_db(fresh)
        assert describe(pg_db) == describe(fresh)
    with database(pg_db) as conn:
        assert conn.schema_version() == campaignapi.SCHEMA_VERSION
        assert conn.execute("SELECT count(*) FROM recipient").fetchone()[0] == 4
        _refused(conn, "INSERT INTO recipient (datasource, email) VALUES (3, 'x@example.com')",
                 "recipient_datasource_fkey")

