"""CSV imports and quotes (API.md section 5): a quoted field that spans lines
is kept only where it closes on a row of the header's width; an unclosed
quote, or a quoted field that swallows what reads as further rows, is a row
error naming the lines, and the rows after it are imported.

Every case runs small and at 1 MiB or more (on SQLite a child process reads
those), as csv and base64 uploads, on the engine of CAMPAIGNAPI_TEST_ENGINE
(PostgreSQL writes by COPY)."""

import re

import pytest

import campaignapi
from helpers import database, get_import, import_csv, make_datasource

HEADER = "email,first,count,born,member\r\n"
# Quoted rows before the case (the file has quotes either way, so the csv
# module reads it), enough of them to pass 1 MiB for the large uploads.
FILLER_ROW = 'filler{}@example.com,"Filler {}",1,1980-01-01,1\r\n'
# internal: shrunk so a small upload takes the child reader's path
LARGE_ROWS = campaignapi._CHILD_READS_BYTES // 40


def upload(rows_before, case):
    """The file: the header, ``rows_before`` filler rows, then ``case``; and
    the line number of the case's first line."""
    filler = "".join(FILLER_ROW.format(n, n) for n in range(rows_before))
    return HEADER + filler + case, rows_before + 2


@pytest.fixture(params=["small", "large"])
def before(request):
    return 3 if request.param == "small" else LARGE_ROWS


@pytest.fixture(params=["csv", "base64"])
def uploadtype(request):
    return request.param


def run(api, db, before, case, uploadtype):
    """Import ``case`` after ``before`` filler rows: the import record, which
    has finished, the recipients but the filler ({email: {field: value}}),
    and the line number of the case's first line."""
    text, line = upload(before, case)
    ds = make_datasource(api)
    if before == LARGE_ROWS:
        # internal: shrunk so a small upload takes the child reader's path
        assert len(text.encode()) >= campaignapi._CHILD_READS_BYTES == 1 << 20
    made = import_csv(api, ds, text, uploadtype=uploadtype)
    record = get_import(api, ds, made["id"])
    assert record["status"] == "finished"
    with database(db) as conn:
        names = {row["id"]: row["name"] for row in conn.execute(
            "SELECT id, name FROM field WHERE datasource = ?", (ds,))}
        people = {row["email"]: {names[int(key)]: value for key, value in
                                 campaignapi.json.loads(row["data"]).items()}
                  for row in conn.execute("SELECT email, data FROM recipient "
                                          "WHERE datasource = ? AND email NOT LIKE 'filler%'",
                                          (ds,))}
    return record, people, line


def lines_named(error):
    """The line numbers an error message names ("lines 7-9", "line 8")."""
    return [int(n) for n in re.findall(r"\d+", " ".join(re.findall(
        r"lines? \d+(?:-\d+)?", error)))]


def test_an_unclosed_quote_loses_no_row_after_it(api, db, before, uploadtype):
    """The issue's case: good5's quote never closes; good6 and good7 (whose
    quoted name would close it) are imported as they are written."""
    case = ('good4@example.com,Four,1,1980-01-01,1\r\n'
            'good5@example.com,"Unclosed,1,1980-01-01,1\r\n'
            'good6@example.com,Six,1,1980-01-01,1\r\n'
            'good7@example.com,"Seven",1,1980-01-01,0\r\n'
            'good8@example.com,Eight,2,1990-02-02,1\r\n')
    record, people, line = run(api, db, before, case, uploadtype)
    assert sorted(people) == ["good4@example.com", "good6@example.com", "good7@example.com",
                              "good8@example.com"]
    assert people["good6@example.com"]["first"] == "Six"
    assert people["good7@example.com"] == {"first": "Seven", "count": "1", "born": "1980-01-01",
                                           "member": "0"}
    assert record["inserted"] == str(before + 4) and record["skipped"] == "1"
    [error] = record["errors"]
    assert error["row"] == str(line + 1)       # rows are records: here one a line
    assert lines_named(error["error"])[0] == line + 1
    assert "quote" in error["error"]


def test_an_unclosed_quote_on_the_last_line(api, db, before, uploadtype):
    case = ('good1@example.com,One,1,1980-01-01,1\r\n'
            'good2@example.com,"Never closed,1,1980-01-01,1\r\n')
    record, people, line = run(api, db, before, case, uploadtype)
    assert sorted(people) == ["good1@example.com"]
    [error] = record["errors"]
    assert error["row"] == str(line + 1) and lines_named(error["error"])[0] == line + 1
    assert "never closed" in error["error"]


def test_a_quoted_field_that_swallows_rows_and_closes_at_the_header_width(
        api, db, before, uploadtype):
    """The quote closes on a later row and the record has the header's width,
    but lines inside it read as rows of their own: those rows are kept."""
    case = ('good1@example.com,"Oops,1,1980-01-01,1\r\n'
            'good2@example.com,Two,2,1980-01-01,1\r\n'
            'good3@example.com,Three",3,1980-01-01,1\r\n'
            'good4@example.com,Four,4,1980-01-01,1\r\n')
    record, people, line = run(api, db, before, case, uploadtype)
    assert sorted(people) == ["good2@example.com", "good3@example.com", "good4@example.com"]
    assert people["good2@example.com"]["first"] == "Two"
    assert people["good3@example.com"]["first"] == 'Three"'   # a stray quote, as written
    [error] = record["errors"]
    assert error["row"] == str(line) and lines_named(error["error"])[:2] == [line, line + 2]


def test_a_quoted_field_that_closes_on_a_row_of_another_width(api, db, before, uploadtype):
    case = ('good1@example.com,"Two lines\r\n'
            'of text",1,1980-01-01\r\n'           # closes, but 4 columns of 5
            'good2@example.com,Two,2,1980-01-01,1\r\n')
    record, people, line = run(api, db, before, case, uploadtype)
    assert sorted(people) == ["good2@example.com"]
    [first, second] = record["errors"]
    assert first["row"] == str(line) and lines_named(first["error"])[:2] == [line, line + 1]
    # The line after it is read again on its own: a row without an address.
    assert second["row"] == str(line + 1) and "address" in second["error"]


def test_quoted_fields_over_several_lines_are_kept(api, db, before, uploadtype):
    case = ('ann@example.com,"Ann\r\nMarie",1,1980-01-01,1\r\n'
            'bob@example.com,"Bob ""the builder""\nof\nLondon",2,1981-01-01,0\r\n'
            'cid@example.com,"Cid, with a comma",3,1982-01-01,1\r\n'
            'dan@example.com,Dan,4,"1983-01-01",1\r\n')
    record, people, _ = run(api, db, before, case, uploadtype)
    assert record["errors"] == []
    assert people["ann@example.com"]["first"] == "Ann\r\nMarie"
    assert people["bob@example.com"]["first"] == 'Bob "the builder"\nof\nLondon'
    assert people["cid@example.com"]["first"] == "Cid, with a comma"
    assert people["dan@example.com"]["born"] == "1983-01-01"
    assert record["inserted"] == str(before + 4)


def test_rows_are_numbered_as_before_after_a_field_over_lines(api, db, uploadtype):
    """Row numbers count records (a field over two lines is one row); the
    error names the lines of the file."""
    case = ('ann@example.com,"Ann\nMarie",1,1980-01-01,1\r\n'      # row 2, lines 2-3
            'bad@example.com,"Unclosed,1,1980-01-01,1\r\n'         # row 3, line 4
            'cid@example.com,Cid,3,1982-01-01,1\r\n')              # row 4, line 5
    record, people, line = run(api, db, 0, case, uploadtype)
    assert line == 2
    assert sorted(people) == ["ann@example.com", "cid@example.com"]
    [error] = record["errors"]
    assert error["row"] == "3" and lines_named(error["error"])[0] == 4
