"""Imports: the fast paths (quote-free CSV split by hand, a column checked at
once, chunks read in a child process) give exactly what the slow ones give."""

import json
import os
import random
import re
import socket
import threading
import time

import pytest

import campaignapi
from helpers import database, get_import, import_csv, make_datasource, scalar

HEADER = ["email", "Name", "age", "City"]


def rows_with_every_case():
    """Rows that take each path: normal addresses, ones to normalize, invalid
    and blank ones, short rows, blank and bad typed cells, repeats near and
    far, non-ASCII, addresses that the datasource already has."""
    rows = []
    for i in range(60):
        rows.append([f"user{i}@example.com", f"Name {i}", str(20 + i % 50), f"City {i % 7}"])
    rows += [
        [" Spaced@Example.COM ", "Spaced", "33", "Köln"],        # normalized
        ["UPPER@EXAMPLE.ORG", "Upper", "", " "],                  # normalized, blank cells
        ["not-an-address", "Bad", "1", "x"],                      # invalid
        ["", "", "", ""],                                          # a blank line
        ["", "No address", "2", "y"],                             # no address
        ["short@example.com", "Short"],                           # padded
        ["typed@example.com", "Typed", "forty", "z"],             # bad integer
        ["user3@example.com", "Repeat near", "44", "r"],          # repeat of an earlier row
        ["USER5@example.com", "Repeat other case", "", "r"],      # repeat, other case
        ["known1@example.com", "Known again", "50", ""],          # a recipient already there
        ["Known2@Example.com", "Known other case", "", "k"],
        ["ünï@example.com", "Non-ASCII", "7", "Zürich"],
        ["x" * 65 + "@example.com", "Too long", "1", "a"],        # local part over 64
    ]
    rows += [[f"user{i}@example.com", f"Late {i}", "", f"L{i}"] for i in range(0, 60, 9)]
    return rows


def csv_text(rows, quoted=False, delimiter=","):
    quote = (lambda cell: '"' + cell.replace('"', '""') + '"') if quoted else (lambda c: c)
    return "".join(delimiter.join(map(quote, row)) + "\r\n" for row in [HEADER] + rows)


def known(api, ds):
    for address in ("known1@example.com", "known2@example.com"):
        api.put(f"/datasource/{ds}/recipient/0", email=address, fields={"Name": "Before"})


def outcome(api, db, ds, import_id):
    """Everything an import leaves, free of ids that differ between datasources."""
    record = get_import(api, ds, import_id)
    with database(db) as conn:
        names = {str(row["id"]): row["name"] for row in conn.execute(
            "SELECT id, name FROM field WHERE datasource = ?", (ds,))}
        people = [(row["email"], row["status"], row["import"] is not None,
                   {names[key]: value for key, value in json.loads(row["data"]).items()})
                  for row in conn.execute("SELECT * FROM recipient WHERE datasource = ? "
                                          "ORDER BY id", (ds,))]
    figures = {key: record[key] for key in ("rows", "inserted", "updated", "skipped", "errors")}
    return figures, sorted(names.values()), people


def run(api, db, text, name):
    ds = make_datasource(api, name=name, fields=[{"name": "age", "type": "integer"},
                                                 {"name": "Name", "type": "text"}])
    known(api, ds)
    import_id = import_csv(api, ds, text)["id"]
    return outcome(api, db, ds, import_id)


@pytest.mark.parametrize("chunk", [7, 5000])
def test_every_path_gives_the_same_outcome(api, db, monkeypatch, chunk):
    # internal: small chunks, so that a few rows cross chunks as many do
    monkeypatch.setattr(campaignapi, "_CHUNK_ROWS", chunk)
    rows = rows_with_every_case()
    outcomes = {}
    for child in (False, True):
        # 0: every CSV goes through the child process (on SQLite).
        # internal: the size that sends a CSV to the reading child
        monkeypatch.setattr(campaignapi, "_CHILD_READS_BYTES", 0 if child else 1 << 40)
        outcomes["fast", child] = run(api, db, csv_text(rows), f"fast{child}")
        outcomes["quoted", child] = run(api, db, csv_text(rows, quoted=True), f"quoted{child}")
        outcomes["semicolon", child] = run(api, db, csv_text(rows, delimiter=";"), f"semi{child}")
        with monkeypatch.context() as slow:
            # internal: no address counts as normal: every row goes the row-by-row path
            slow.setattr(campaignapi, "_EMAIL_NORMAL_RE", re.compile(r"(?!)"))
            outcomes["row by row", child] = run(api, db, csv_text(rows), f"slow{child}")
    reference = outcomes.pop(("row by row", False))
    for path, result in outcomes.items():
        assert result == reference, (path, result[0], reference[0])
    figures, fields, people = reference
    assert figures["rows"] == str(len(rows) - 1)             # the blank line is no row
    assert (figures["inserted"], figures["updated"], figures["skipped"]) == ("64", "2", "4")
    assert [(e["row"], e["error"]) for e in figures["errors"]] == [
        ("64", "'not-an-address' is not a valid email address"),
        ("66", "no email address"),
        ("68", "age: 'forty' is not a whole number"),
        ("74", f"'{'x' * 65}@example.com' is not a valid email address")]
    assert fields == ["City", "Name", "age", "email"]
    by_address = {person[0].lower(): person for person in people}
    assert by_address["spaced@example.com"][3] == {"Name": "Spaced", "age": 33, "City": "Köln"}
    assert by_address["upper@example.org"][3] == {"Name": "Upper"}
    assert by_address["short@example.com"][3] == {"Name": "Short"}
    assert by_address["user3@example.com"][3] == {"Name": "Repeat near", "age": 44, "City": "r"}
    assert by_address["user5@example.com"][3] == {"Name": "Repeat other case", "City": "r"}
    assert by_address["user9@example.com"][3] == {"Name": "Late 9", "City": "L9"}
    assert by_address["known1@example.com"][1:] == ("active", False,
                                                    {"Name": "Known again", "age": 50})
    assert by_address["known2@example.com"][3] == {"Name": "Known other case", "City": "k"}


def test_normal_form_regex_agrees_with_normalize_email():
    # The column check may only pass an address that _normalize_email() keeps as it is.
    # internal: the fast check of the import paths against the rule it stands for
    normal, normalize = campaignapi._EMAIL_NORMAL_RE.fullmatch, campaignapi._normalize_email
    rng = random.Random(5)
    pieces = ["a", "B", "é", ".", "@", "-", " ", "x.y", "example", "COM", "com", "\t", "_",
              "1", "ü", '"', "\n"]
    for _ in range(20000):
        candidate = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12)))
        if normal(candidate):
            assert normalize(candidate) == candidate, candidate
    assert normal("a.b@example.com")
    assert not normal("a.b@Example.com")
    assert not normal(" a.b@example.com")


def children():
    """Processes whose parent is this one (a forked reader not reaped would be
    here, next to what other tests of the session left running)."""
    mine = str(os.getpid())
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[1] == mine:
                    found.append(pid)
        except OSError:
            pass
    return set(found)


def engine_writes(db):
    """The class that writes an import's chunks on the engine of ``db``."""
    if db.startswith("postgresql"):
        # internal: where a reading child's chunks are written, to fail or watch a write
        return campaignapi._PgImportWrites
    # internal: where a reading child's chunks are written, to fail or watch a write
    return campaignapi._SqliteImportWrites


def big_upload(count, row=lambda i: f"reader{i}@example.com,Name {i},{i % 90},Town {i % 13}"):
    text = "email,Name,age,Town\n" + "".join(row(i) + "\n" for i in range(count))
    # internal: shrunk so a small upload takes the child reader's path
    assert len(text) >= campaignapi._CHILD_READS_BYTES
    return text


def test_a_big_upload_read_by_the_child_reports_rows_like_in_process(api, db, monkeypatch):
    def row(i):
        if i == 17000:
            return "broken-address,Broken,1,x"
        if i == 21000:
            return "reader5@EXAMPLE.COM,Again,,y"
        return f"reader{i}@example.com,Name {i},{i % 90},Town {i % 13}"

    text = big_upload(25000, row)
    results, before = [], children()
    # internal: shrunk so a small upload takes the child reader's path
    for threshold in (campaignapi._CHILD_READS_BYTES, 1 << 40):
        # internal: the size that sends a CSV to the reading child
        monkeypatch.setattr(campaignapi, "_CHILD_READS_BYTES", threshold)
        results.append(run(api, db, text, f"big{threshold}"))
        assert children() <= before
    assert results[0] == results[1]
    figures = results[0][0]
    assert (figures["rows"], figures["inserted"], figures["skipped"]) == ("25000", "24998", "1")
    assert figures["errors"] == [{"row": "17002",
                                  "error": "'broken-address' is not a valid email address"}]


def test_an_error_in_the_child_rolls_back_everything(api, db):
    ds = make_datasource(api, fields=[{"name": "age", "type": "integer"},
                                      {"name": "Name", "type": "text"}])
    known(api, ds)
    before = children()
    # UTF-16 with a lone surrogate in the middle: the child fails at that block,
    # after chunks before it were written by this process.
    good = "".join(f"p{i}@example.com\tx\r\n" for i in range(20000))
    raw = b"\xff\xfe" + ("email\tnewcolumn\r\n" + good).encode("utf-16-le") + b"\x00\xd8" + \
        good.encode("utf-16-le")
    # internal: shrunk so a small upload takes the child reader's path
    assert len(raw) >= campaignapi._CHILD_READS_BYTES
    error = import_csv(api, ds, raw, uploadtype="base64", status=422)
    assert error["error"] == "invalid_data" and "not readable text" in error["message"]
    assert scalar(db, "SELECT count(*) FROM recipient WHERE datasource = ?", ds) == 2
    assert scalar(db, "SELECT count(*) FROM field WHERE datasource = ?", ds) == 3
    assert scalar(db, "SELECT count(*) FROM import") == 0
    assert children() <= before


def test_a_failure_while_writing_stops_and_reaps_the_child(api, db, monkeypatch):
    ds, before = make_datasource(api), children()
    written = []

    def fail_on_third(self, chunk, keys):
        written.append(chunk)
        if len(written) == 3:
            raise campaignapi.Conflict("stop here")
        return write(self, chunk, keys)

    # internal: a failure injected between two chunk writes of the engine's import
    writes = engine_writes(db)
    write = writes.unpack
    monkeypatch.setattr(writes, "unpack", fail_on_third)
    error = import_csv(api, ds, big_upload(30000), status=409)
    assert error["message"] == "stop here"
    assert scalar(db, "SELECT count(*) FROM recipient") == 0
    assert scalar(db, "SELECT count(*) FROM field WHERE datasource = ?", ds) == 1
    assert len(written) == 3 and children() <= before


def test_a_child_read_upload_without_a_stored_row_makes_no_field(api, db):
    ds, before = make_datasource(api), children()
    text = big_upload(40000, row=lambda i: f"broken{i},Name {i},{i % 90},Town")
    record = get_import(api, ds, import_csv(api, ds, text)["id"])
    assert (record["rows"], record["inserted"], record["skipped"]) == ("40000", "0", "40000")
    assert scalar(db, "SELECT count(*) FROM field WHERE datasource = ?", ds) == 1
    assert children() <= before


def test_the_reading_child_keeps_no_socket_of_the_app_open(api, db, monkeypatch):
    """A connection the app closes while the child reads is closed for its
    client at once, not when the import ends: the child keeps only its pipe."""
    ds, seen = make_datasource(api), []
    ours, peer = socket.socketpair()   # stands for a client connection of the app

    def closing_a_connection(self, chunk, keys):
        if not seen:   # the child is reading the next chunks meanwhile
            ours.close()
            peer.settimeout(5)
            seen.append(peer.recv(1))   # end of stream, unless a copy is open
        return write(self, chunk, keys)

    # internal: a client closed while the child reads, between two chunk writes
    writes = engine_writes(db)
    write = writes.unpack
    monkeypatch.setattr(writes, "unpack", closing_a_connection)
    try:
        import_csv(api, ds, big_upload(30000))
    finally:
        peer.close()
    assert seen == [b""]


def test_a_big_body_is_parsed_by_the_child_not_by_the_server(api, db, monkeypatch):
    """The JSON of a big import body is parsed in the child (both engines):
    the request's process never decodes it; a small body is parsed here."""
    # internal: where a request body is parsed, to see which process does it
    parsed_here, parse = [], campaignapi._json_object
    ds, before = make_datasource(api), children()

    def recording(body):   # runs in the child too, where its list is the child's
        parsed_here.append(len(body))
        return parse(body)

    # internal: where a request body is parsed, to see which process does it
    monkeypatch.setattr(campaignapi, "_json_object", recording)
    record = get_import(api, ds, import_csv(api, ds, big_upload(30000))["id"])
    assert (record["status"], record["inserted"]) == ("finished", "30000")
    assert parsed_here == [] and children() <= before
    import_csv(api, ds, "email\nsmall@example.com\n")
    assert len(parsed_here) == 1


def test_a_bad_big_body_is_refused_as_in_process(api, db):
    """The child's parse answers what the request's process would: 400 for
    JSON that does not parse, 422 for an upload that is no base64."""
    ds, before = make_datasource(api), children()
    # internal: a body big enough for the child
    padding = "x" * campaignapi._CHILD_READS_BYTES
    broken = f'{{"name": "x", "originalfile": "{padding}", "__uploadtype__": "csv",'.encode()
    response = api.client.put(f"/v1/datasource/{ds}/import/0", broken, headers={
        **api.headers, "Content-Type": "application/json"}, expect_errors=True)
    assert response.status_int == 400 and response.json["data"]["error"] == "invalid_json"
    error = api.put(f"/datasource/{ds}/import/0", status=422, name="x", originalfile="x.csv",
                    __uploadtype__="base64", __uploaddata__="!" + padding)
    assert error["error"] == "invalid_data" and "base64" in error["message"]
    assert scalar(db, "SELECT count(*) FROM import") == 0 and children() <= before


def test_a_writer_that_comes_during_an_import_goes_before_the_import_ends(
        api, db, monkeypatch):
    """A write with a key that comes while the child reads does not wait for
    the import's commit (made here as large as the upload): the import
    commits what it wrote and lets the writer go first."""
    if db.startswith("postgresql"):
        pytest.skip("PostgreSQL writers wait only for the rows they touch")
    # internal: one commit for the whole upload unless a writer waits
    monkeypatch.setattr(campaignapi, "_COMMIT_ROWS", 10**9)
    ds, seen, threads = make_datasource(api), [], []
    writes = engine_writes(db)
    write = writes.unpack

    def writer():
        api.put("/datasource/0", name="made during the import")
        seen.append(scalar(db, "SELECT count(*) FROM recipient WHERE datasource = ?", ds))

    def with_a_writer(self, chunk, keys):
        write(self, chunk, keys)
        if not threads:   # the first statement is written: a writer comes now
            threads.append(threading.Thread(target=writer))
            threads[0].start()
            # internal: go on once the writer waits for its turn (bounded)
            turns = self.importer.conn.turns
            for _ in range(500):
                if turns.queue or seen:
                    break
                time.sleep(0.01)

    # internal: a writer started between two statements of the import
    monkeypatch.setattr(writes, "unpack", with_a_writer)
    record = get_import(api, ds, import_csv(api, ds, big_upload(30000))["id"])
    threads[0].join(30)
    assert record["inserted"] == "30000"
    assert len(seen) == 1 and 0 < seen[0] < 30000   # committed while the import ran
