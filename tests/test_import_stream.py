"""Imports on PostgreSQL (issue 19): into a datasource that is empty when the
import begins the rows go straight into recipient by one COPY kept open
(campaignapi._CopyStream), else through a staging table; recipient.datasource
and recipient.import are checked once a statement by triggers instead of
foreign keys.  Both paths must store the same thing, the triggers must behave
as the foreign keys did.  The cases that name the engine run on both (the
behaviour is the same on SQLite); the others skip on SQLite."""

import contextlib
import csv
import io

import pytest

import campaignapi
from conftest import TEST_ENGINE
from helpers import database, get_import, import_csv, make_datasource, recipients, scalar

on_postgresql = pytest.mark.skipif(TEST_ENGINE != "postgresql",
                                   reason="the COPY paths and triggers of PostgreSQL")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 50 rows and segments of 120, so that a few hundred rows
    cross chunks and segments the way a million do."""
    # internal: a chunk every 50 rows, not 5,000
    monkeypatch.setattr(campaignapi, "_CHUNK_ROWS", 50)
    # internal: a COPY segment every 120 rows, not 50,000
    monkeypatch.setattr(campaignapi._CopyStream, "SEGMENT_ROWS", 120)


@pytest.fixture
def paths(monkeypatch):
    """How many chunks each path wrote: {"stream": n, "stage": n}."""
    counts = {"stream": 0, "stage": 0}
    # internal: which of PostgreSQL's two write paths an import took, counted where it writes
    stream, staging = campaignapi._CopyStream, campaignapi._PgImportWrites
    write, stage = stream.write, staging.stage

    def counted_write(self, pending, texts=None):
        counts["stream"] += 1
        return write(self, pending, texts)

    def counted_stage(self, pending):
        counts["stage"] += 1
        return stage(self, pending)

    monkeypatch.setattr(stream, "write", counted_write)
    monkeypatch.setattr(staging, "stage", counted_stage)
    return counts


def _csv(rows):
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["email", "name", "age"])
    writer.writerows(rows)
    return out.getvalue()


def _upload():
    """400 rows: repeats in the same chunk and in later chunks and segments,
    other case, blank values that remove a value, an invalid address."""
    rows = [[f"user{i}@example.com", f"Name {i}", str(20 + i % 50)] for i in range(400)]
    rows[10] = ["USER3@Example.com", "Three again", ""]          # same chunk, blank age
    rows[75] = ["user5@EXAMPLE.COM", "", "55"]                    # next chunk
    rows[130] = ["User5@example.com", "Five last", ""]            # next segment
    rows[260] = ["user199@example.com", "", "1"]                  # an earlier segment
    rows[300] = ["not an address", "x", "3"]
    rows[399] = ["user0@example.com", "Zero last", "9"]
    return _csv(rows)


def _figures(api, ds, import_id):
    record = get_import(api, ds, import_id)
    return {name: record[name] for name in ("rows", "inserted", "updated", "skipped")}


def _stored(api, ds):
    """{address: (status, name, age)} of the datasource's recipients (fewer than 1000)."""
    return {address: (record["status"], record["fields"]["name"], record["fields"]["age"])
            for address, record in recipients(api, ds).items()}


def test_stream_and_staging_store_the_same(api, small_chunks, paths):
    streamed = make_datasource(api, "streamed", fields=[{"name": "age", "type": "integer"}])
    staged = make_datasource(api, "staged", fields=[{"name": "age", "type": "integer"}])
    # One recipient of another address makes the second datasource not empty.
    api.put(f"/datasource/{staged}/recipient/0", email="someone@example.org")
    first = import_csv(api, streamed, _upload())["id"]
    if TEST_ENGINE == "postgresql":
        assert paths["stream"] > 0 and paths["stage"] > 0   # the repeats are staged
        paths.update(stream=0, stage=0)
    second = import_csv(api, staged, _upload())["id"]
    if TEST_ENGINE == "postgresql":
        assert paths["stream"] == 0 and paths["stage"] > 0
    assert _figures(api, streamed, first) == _figures(api, staged, second) == {
        "rows": "400", "inserted": "394", "updated": "0", "skipped": "1"}
    stored = _stored(api, streamed)
    other = _stored(api, staged)
    assert other.pop("someone@example.org") == ("active", None, None)
    assert stored == other      # the addresses as they are spelled, too
    stored = {address.lower(): values for address, values in stored.items()}
    assert stored["user3@example.com"] == ("active", "Three again", None)
    assert stored["user5@example.com"] == ("active", "Five last", None)
    assert stored["user199@example.com"] == ("active", None, "1")   # a blank cell removes
    assert stored["user0@example.com"] == ("active", "Zero last", "9")
    assert "not an address" not in stored


def test_a_second_import_updates_what_the_stream_stored(api, small_chunks, paths):
    ds = make_datasource(api, fields=[{"name": "age", "type": "integer"}])
    import_csv(api, ds, _upload())
    again = import_csv(api, ds, _csv([["user1@example.com", "One", "31"],
                                      ["new@example.com", "New", ""]]))["id"]
    assert _figures(api, ds, again) == {"rows": "2", "inserted": "1", "updated": "1",
                                        "skipped": "0"}
    stored = _stored(api, ds)
    assert stored["user1@example.com"] == ("active", "One", "31")
    assert stored["new@example.com"] == ("active", "New", None)


def test_a_field_made_in_the_middle_of_the_stream(api, small_chunks):
    # A json upload names a new field after the COPY has begun: making it
    # ends the segment first (nothing else runs while a COPY is open).
    ds = make_datasource(api)
    rows = [{"email": f"p{i}@example.com", "city": f"C{i}"} for i in range(130)]
    rows += [{"email": f"q{i}@example.com", "team": "blue"} for i in range(70)]
    rows += [{"email": "p3@example.com", "team": "red"}]
    record = api.put(f"/datasource/{ds}/import/0", name="json", originalfile="",
                     __uploadtype__="json", __uploaddata__=rows)
    assert _figures(api, ds, record["id"]) == {"rows": "201", "inserted": "200", "updated": "0",
                                               "skipped": "0"}
    page = api.get(f"/datasource/{ds}/recipient/all", limit=1000)["recipient"]
    fields = {r["email"]: r["fields"] for r in page}
    assert fields["p3@example.com"]["city"] == "C3" and fields["p3@example.com"]["team"] == "red"
    assert fields["q69@example.com"]["team"] == "blue"


def test_erased_addresses_come_back_unsubscribed_from_the_stream(api, db, small_chunks, paths):
    ds = make_datasource(api)
    for address in ("user7@example.com", "user150@example.com"):
        recipient = api.put(f"/datasource/{ds}/recipient/0", email=address)["id"]
        api.delete(f"/datasource/{ds}/recipient/{recipient}")
    fresh = make_datasource(api, "fresh")
    import_csv(api, fresh, _upload())
    if TEST_ENGINE == "postgresql":
        assert paths["stream"] > 0
    stored = _stored(api, fresh)
    assert stored["user7@example.com"][0] == stored["user150@example.com"][0] == "unsubscribed"
    assert stored["user8@example.com"][0] == "active"
    assert scalar(db, "SELECT count(*) FROM recipient WHERE status = 'unsubscribed'") == 2


# -- The importer by itself, in a transaction of the test's --------------------


def _rows(importer, addresses, start=2):
    for number, address in enumerate(addresses, start):
        importer.add(number, address, (), ())


@contextlib.contextmanager
def _importing(conn, ds, import_id=None):
    """An importer in a transaction of its own on ``conn``."""
    with campaignapi.transaction(conn):
        # internal: an importer fed row by row, to place rows at chunk and segment ends
        yield campaignapi._Importer(conn, ds, import_id)


def _new_import(conn, ds):
    with campaignapi.transaction(conn):
        return conn.execute("INSERT INTO import (datasource, uploadtype) VALUES (?, 'csv')",
                            (ds,)).lastrowid


@on_postgresql
def test_an_address_stored_meanwhile_sends_the_segment_to_staging(api, db, small_chunks, paths):
    ds = make_datasource(api)
    addresses = [f"r{i}@example.com" for i in range(100)]
    with database(db) as conn:
        with _importing(conn, ds, _new_import(conn, ds)) as importer:
            _rows(importer, addresses[:60])        # one chunk streamed, the COPY left open
            assert importer.writes.stream and importer.writes.stream.copy is not None
            # Another writer stores one of the next addresses and commits.
            api.put(f"/datasource/{ds}/recipient/0", email="R70@example.com")
            _rows(importer, addresses[60:], 62)
            importer.finish()
            assert (importer.inserted, importer.updated) == (99, 1)
    assert paths["stage"] >= 2
    assert scalar(db, "SELECT count(*) FROM recipient WHERE datasource = ?", ds) == 100
    # The stored address is kept, as an update keeps it.
    assert scalar(db, "SELECT email FROM recipient WHERE email = 'r70@example.com'") == \
        "R70@example.com"


@on_postgresql
def test_an_error_during_the_stream_leaves_nothing(api, db, small_chunks):
    ds = make_datasource(api)
    with database(db) as conn:
        with pytest.raises(ZeroDivisionError):
            with _importing(conn, ds) as importer:
                _rows(importer, [f"r{i}@example.com" for i in range(110)])
                assert importer.writes.stream.copy is not None
                1 / 0
        assert conn.execute("SELECT count(*) FROM recipient").fetchone()[0] == 0
        # The connection's next transaction is a clean one.
        with _importing(conn, ds) as importer:
            _rows(importer, ["after@example.com"])
            importer.finish()
    assert scalar(db, "SELECT count(*) FROM recipient") == 1


# -- recipient.datasource and recipient.import as foreign keys -----------------


def _fk_error(error, message, detail):
    """``error`` is PostgreSQL's foreign key error, word for word."""
    assert isinstance(error, campaignapi.INTEGRITY_ERRORS) and error.sqlstate == "23503"
    assert (error.diag.message_primary, error.diag.message_detail) == (message, detail)


@on_postgresql
@pytest.mark.parametrize("stream", [True, False])
def test_an_import_into_a_datasource_that_is_gone_fails_as_before(db, small_chunks, stream):
    with database(db) as conn:
        with pytest.raises(campaignapi.INTEGRITY_ERRORS) as excinfo:
            with _importing(conn, 999) as importer:
                importer.writes.stream = None if stream else False
                _rows(importer, [f"r{i}@example.com" for i in range(80)])
                importer.finish()
    _fk_error(excinfo.value, 'insert or update on table "recipient" violates foreign key '
                             'constraint "recipient_datasource_fkey"',
              'Key (datasource)=(999) is not present in table "datasource".')
    assert excinfo.value.diag.constraint_name == "recipient_datasource_fkey"
    assert scalar(db, "SELECT count(*) FROM recipient") == 0


@on_postgresql
def test_an_import_whose_record_is_gone_fails_as_before(api, db, small_chunks):
    ds = make_datasource(api)
    with database(db) as conn:
        with pytest.raises(campaignapi.INTEGRITY_ERRORS) as excinfo:
            with _importing(conn, ds, import_id=4242) as importer:
                _rows(importer, [f"r{i}@example.com" for i in range(80)])
                importer.finish()
    _fk_error(excinfo.value, 'insert or update on table "recipient" violates foreign key '
                             'constraint "recipient_import_fkey"',
              'Key (import)=(4242) is not present in table "import".')


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
def test_a_datasource_cannot_go_while_an_import_writes_into_it(api, db, small_chunks):
    # The import's check locks the datasource row (FOR KEY SHARE) as a
    # foreign key does: a delete from elsewhere waits, then fails.
    import psycopg

    ds = make_datasource(api)
    with database(db) as conn, _importing(conn, ds) as importer:
        _rows(importer, [f"r{i}@example.com" for i in range(80)])
        importer.finish()
        with psycopg.connect(db, autocommit=True) as other:
            other.execute("SET lock_timeout = '200ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute("DELETE FROM datasource WHERE id = %s", (ds,))
    with psycopg.connect(db) as other:
        other.execute("DELETE FROM field WHERE datasource = %s", (ds,))
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            other.execute("DELETE FROM datasource WHERE id = %s", (ds,))


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


# -- Version 2 of PostgreSQL: foreign keys, a trigger per row, a b-tree ------------------

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
            # internal: the tables of the id trigger, whose version-2 form this test rebuilds
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
