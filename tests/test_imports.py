"""Imports: CSV as real files come, json, upsert, figures, notifications."""

import time

import pytest

import campaignapi
from helpers import database, get_import, import_csv, make_datasource, recipients, scalar


@pytest.fixture
def ds(api):
    return make_datasource(api, fields=[{"name": "age", "type": "integer"},
                                        {"name": "joined", "type": "date"}])


def test_excel_semicolon_export_with_bom_quotes_and_newlines(api, ds):
    # What Excel writes for "CSV UTF-8" in a ';' locale: BOM, CRLF, quoted cells.
    text = ("\ufeffE-Mail;Name;Street;age\r\n"
            'ann@Example.COM;"Ann; Jr.";"Main St 1,\r\nBack door";41\r\n'
            'bob@example.com;"Bob ""B"" Brown";;\r\n'
            ";;;\r\n")
    import_id = import_csv(api, ds, text, uploadtype="base64")["id"]
    record = get_import(api, ds, import_id)
    assert (record["rows"], record["inserted"], record["updated"], record["skipped"]) == \
        ("2", "2", "0", "0")
    people = recipients(api, ds)
    ann = people["ann@example.com"]["fields"]
    assert ann["Name"] == "Ann; Jr."
    assert ann["Street"] == "Main St 1,\r\nBack door"
    assert ann["age"] == "41"
    bob = people["bob@example.com"]["fields"]
    assert bob["Name"] == 'Bob "B" Brown' and bob["Street"] is None and bob["age"] is None
    fields = {f["name"]: f["type"] for f in api.get(f"/datasource/{ds}")["datasource"]["fields"]}
    assert fields == {"email": "email", "age": "integer", "joined": "date", "Name": "text",
                      "Street": "text"}


def test_latin1_file_falls_back_from_utf8(api, ds):
    text = "email\tcity\nfrancois@example.com\tBéziers\nzoe@example.com\tMünchen\n"
    import_csv(api, ds, text, uploadtype="base64", encoding="latin-1")
    people = recipients(api, ds)
    assert people["francois@example.com"]["fields"]["city"] == "Béziers"
    assert people["zoe@example.com"]["fields"]["city"] == "München"


def test_utf8_without_bom_and_excel_sep_line(api, ds):
    text = "sep=|\nemail|city\nx@example.com|Łódź, PL\n"
    import_csv(api, ds, text, uploadtype="base64")
    assert recipients(api, ds)["x@example.com"]["fields"]["city"] == "Łódź, PL"


def test_utf16_tab_separated(api, ds):
    # Excel's "Unicode text": UTF-16 with a BOM, tab separated.
    raw = "email\tcity\r\nu@example.com\tKøbenhavn\r\n".encode("utf-16")
    import_csv(api, ds, raw, uploadtype="base64")
    assert recipients(api, ds)["u@example.com"]["fields"]["city"] == "København"


def test_duplicate_emails_differing_in_case_count_once_last_wins(api, ds):
    text = ("email,age\nJoe@Example.com,1\nmary@example.com,2\njoe@example.com,3\n"
            "JOE@EXAMPLE.COM,4\n")
    record = get_import(api, ds, import_csv(api, ds, text)["id"])
    assert (record["rows"], record["inserted"], record["updated"]) == ("4", "2", "0")
    people = recipients(api, ds)
    assert len(people) == 2
    assert people["JOE@example.com"]["fields"]["age"] == "4"


def test_repeats_across_chunks_count_once(api, ds, monkeypatch):
    # internal: chunks of 2 rows, so that repeats fall in different chunks
    monkeypatch.setattr(campaignapi, "_CHUNK_ROWS", 2)
    import_csv(api, ds, "email,age\nold@example.com,1\n")
    text = ("email,age\nold@example.com,2\nnew@example.com,3\nOLD@example.com,4\n"
            "x@example.com,5\nNEW@example.com,6\nold@example.com,7\n")
    record = get_import(api, ds, import_csv(api, ds, text)["id"])
    assert (record["rows"], record["inserted"], record["updated"]) == ("6", "2", "1")
    people = recipients(api, ds)
    assert people["old@example.com"]["fields"]["age"] == "7"
    assert people["new@example.com"]["fields"]["age"] == "6"


def test_email_normalised_and_bad_rows_reported_with_row_numbers(api, ds):
    text = ('email,age,joined\n'
            '  Ann@EXAMPLE.Com ,1,2024-01-31\n'
            'not-an-email,2,\n'
            ',3,\n'
            'carl@example.com,three,\n'
            '"multi\nline@example.com",4,\n'
            'dora@example.com,5,2024-02-30\n'
            'eve@example.com,6\n')
    record = get_import(api, ds, import_csv(api, ds, text)["id"])
    assert record["skipped"] == "5" and record["inserted"] == "2"
    assert record["errors"] == [
        {"row": "3", "error": "'not-an-email' is not a valid email address"},
        {"row": "4", "error": "no email address"},
        {"row": "5", "error": "age: 'three' is not a whole number"},
        {"row": "6", "error": "'multi\nline@example.com' is not a valid email address"},
        {"row": "7", "error": "joined: '2024-02-30' is not a date (YYYY-MM-DD)"},
    ]
    people = recipients(api, ds)
    assert set(people) == {"Ann@example.com", "eve@example.com"}
    assert people["Ann@example.com"]["fields"]["joined"] == "2024-01-31"


def test_only_first_100_errors_are_kept(api, ds):
    text = "email\n" + "".join(f"bad{i}\n" for i in range(250)) + "ok@example.com\n"
    record = get_import(api, ds, import_csv(api, ds, text)["id"])
    assert record["skipped"] == "250" and record["inserted"] == "1"
    assert len(record["errors"]) == 100 and record["errors"][-1]["row"] == "101"


def test_upsert_updates_fields_never_status(api, ds, db):
    import_csv(api, ds, "email,age,city\nann@example.com,1,Rome\nbob@example.com,2,Oslo\n")
    with database(db) as conn:
        conn.execute("UPDATE recipient SET status = 'unsubscribed' WHERE email = 'ann@example.com'")
    record = get_import(api, ds, import_csv(api, ds, "email,age\nANN@example.com,5\n"
                                                     "cid@example.com,\n")["id"])
    assert (record["inserted"], record["updated"]) == ("1", "1")
    ann = recipients(api, ds)["ann@example.com"]
    assert ann["status"] == "unsubscribed"
    assert ann["fields"]["age"] == "5" and ann["fields"]["city"] == "Rome"
    # An empty cell clears the value; a column that is absent leaves it.
    import_csv(api, ds, "email,age\nann@example.com,\n")
    ann = recipients(api, ds)["ann@example.com"]
    assert ann["fields"]["age"] is None and ann["fields"]["city"] == "Rome"


def test_json_upload(api, ds):
    rows = [{"Email": "ann@example.com", "age": 31, "vip": True},
            {"email": "bob@example.com", "age": "x"},
            "not an object",
            {"email": "cid@example.com", "tags": ["a"]},
            {"e-mail": "dan@example.com", "age": 4.0}]
    result = api.put(f"/datasource/{ds}/import/0", name="j", originalfile="",
                     __uploadtype__="json", __uploaddata__=rows)
    record = get_import(api, ds, result["id"])
    assert (record["rows"], record["inserted"], record["skipped"]) == ("5", "2", "3")
    assert [e["row"] for e in record["errors"]] == ["2", "3", "4"]
    people = recipients(api, ds)
    assert people["ann@example.com"]["fields"]["vip"] == "1"
    assert people["dan@example.com"]["fields"]["age"] == "4"


def test_json_upload_as_text(api, ds):
    api.put(f"/datasource/{ds}/import/0", name="j", originalfile="", __uploadtype__="json",
            __uploaddata__='[{"email": "t@example.com"}]')
    assert list(recipients(api, ds)) == ["t@example.com"]


@pytest.mark.parametrize("uploadtype, data, words", [
    ("csv", "", "no header"),
    ("csv", "\r\n\r\n", "no header"),
    ("csv", "name,city\nann,Rome\n", "no email column"),
    ("base64", "%%%not base64%%%", "base64"),
    ("json", "{oops", "JSON array"),
    ("json", {"email": "a@example.com"}, "array"),
])
def test_unreadable_data_is_422_and_writes_nothing(api, ds, db, uploadtype, data, words):
    error = api.put(f"/datasource/{ds}/import/0", status=422, name="x", originalfile="",
                    __uploadtype__=uploadtype, __uploaddata__=data)
    assert error["error"] == "invalid_data" and words in error["message"]
    assert scalar(db, "SELECT count(*) FROM import") == 0
    assert scalar(db, "SELECT count(*) FROM field WHERE datasource = ?", ds) == 3
    assert scalar(db, "SELECT count(*) FROM outbox") == 0


def test_failure_late_in_the_file_rolls_back_every_chunk(api, ds, db, monkeypatch):
    # internal: chunks of 100 rows: the failure comes after many were written
    monkeypatch.setattr(campaignapi, "_CHUNK_ROWS", 100)
    good = "".join(f"p{i}@example.com\tx\r\n" for i in range(5000))  # ~250 KB, many chunks
    raw = b"\xff\xfe" + ("email\tnewcolumn\r\n" + good).encode("utf-16-le")
    assert import_csv(api, ds, raw, uploadtype="base64")["id"] == "1"
    api.delete(f"/datasource/{ds}/import/1", id=1)
    field = api.get(f"/datasource/{ds}/modify/newcolumn", new="renamed", type="text")["field"]
    raw += b"\x00\xd8"  # a lone surrogate at the very end: undecodable
    error = import_csv(api, ds, raw, uploadtype="base64", status=422)
    assert error["error"] == "invalid_data"
    assert scalar(db, "SELECT count(*) FROM recipient") == 0
    assert scalar(db, "SELECT count(*) FROM field WHERE datasource = ?", ds) == 4
    assert field["name"] == "renamed"
    assert scalar(db, "SELECT count(*) FROM import") == 0


def test_wrong_upload_type_for_data_is_400(api, ds):
    error = api.put(f"/datasource/{ds}/import/0", status=400, name="x", originalfile="",
                    __uploadtype__="csv", __uploaddata__=[1])
    assert error["field"] == "__uploaddata__"
    error = api.put(f"/datasource/{ds}/import/0", status=400, name="x", originalfile="",
                    __uploadtype__="xml", __uploaddata__="")
    assert error["allowed"] == ["csv", "base64", "json"]
    error = api.put(f"/datasource/{ds}/import/0", status=400, name="x",
                    __uploadtype__="csv", __uploaddata__="email\n")
    assert error["error"] == "missing_parameter"


def test_base64_with_line_breaks_and_data_url(api, ds):
    import base64
    encoded = base64.encodebytes(b"email\nwrapped@example.com\n").decode()
    api.put(f"/datasource/{ds}/import/0", name="x", originalfile="", __uploadtype__="base64",
            __uploaddata__="data:text/csv;base64," + encoded)
    assert list(recipients(api, ds)) == ["wrapped@example.com"]


def test_import_record_and_notification(api, ds, db):
    import_id = api.put(f"/datasource/{ds}/import/7", name="Spring list",
                        originalfile="spring.csv", __uploadtype__="csv",
                        __uploaddata__="email,age\na@example.com,1\nb@example.com,x\n")["id"]
    assert import_id == "7"
    record = get_import(api, ds, 7)
    assert record == {**record, "id": "7", "datasource": str(ds), "name": "Spring list",
                      "originalfile": "spring.csv", "uploadtype": "csv", "status": "finished",
                      "rows": "2", "inserted": "1", "updated": "0", "skipped": "1"}
    assert record["created"] and record["finished"]
    with database(db) as conn:
        mail = conn.execute("SELECT * FROM outbox").fetchall()
    assert len(mail) == 1
    assert mail[0]["kind"] == "notification" and mail[0]["to_addr"] == "owner@example.com"
    assert mail[0]["status"] == "queued"
    assert "Spring list" in mail[0]["subject"] and "1 new" in mail[0]["subject"]
    assert "New recipients:     1" in mail[0]["body"]
    assert "row 3: age: 'x' is not a whole number" in mail[0]["body"]
    # Create at a taken id is 409; the listing pages.
    api.put(f"/datasource/{ds}/import/7", status=409, name="again", originalfile="",
            __uploadtype__="csv", __uploaddata__="email\n")
    import_csv(api, ds, "email\nc@example.com\n")
    page = api.get(f"/datasource/{ds}/import/all", limit=1, offset=1)
    assert page["total"] == "2" and [r["id"] for r in page["import"]] == ["8"]


def test_change_and_delete_import(api, ds, db):
    import_csv(api, ds, "email\nkeep@example.com\n")
    second = import_csv(api, ds, "email\nkeep@example.com\nnew1@example.com\nnew2@example.com\n")
    second = int(second["id"])
    assert api.post(f"/datasource/{ds}/import/{second}", id=second, name="renamed") is True
    assert get_import(api, ds, second)["name"] == "renamed"
    api.post(f"/datasource/{ds}/import/{second}", status=409, id=second + 1, name="x")
    api.delete(f"/datasource/{ds}/import/{second}", status=409, id=second + 1)
    api.delete(f"/datasource/{ds}/import/{second}", status=400)
    assert api.delete(f"/datasource/{ds}/import/{second}", id=second) is True
    # The recipients it inserted go; the one it only updated stays.
    assert list(recipients(api, ds)) == ["keep@example.com"]
    api.get(f"/datasource/{ds}/import/{second}", status=404)


def test_deleted_datasource_reads_work_writes_conflict(api, ds):
    first = import_csv(api, ds, "email\na@example.com\n")["id"]
    api.delete(f"/datasource/{ds}", id=ds)
    assert get_import(api, ds, first)["inserted"] == "1"
    assert list(recipients(api, ds)) == ["a@example.com"]
    import_csv(api, ds, "email\nb@example.com\n", status=409)
    api.post(f"/datasource/{ds}/import/{first}", status=409, id=int(first), name="x")
    api.delete(f"/datasource/{ds}/import/{first}", status=409, id=int(first))


def test_100k_row_file_through_the_api(api, ds, capsys):
    rows = 100_000
    text = "email,first name,age,city\n" + "".join(
        f"user{i}@example.com,Name {i},{i % 90},City {i % 500}\n" for i in range(rows))
    started = time.perf_counter()
    import_id = import_csv(api, ds, text)["id"]
    seconds = time.perf_counter() - started
    record = get_import(api, ds, import_id)
    assert (record["rows"], record["inserted"], record["skipped"]) == (str(rows), str(rows), "0")
    assert api.get(f"/datasource/{ds}")["datasource"]["recipients"] == str(rows)
    with capsys.disabled():
        print(f"\n100,000-row import through the API: {seconds:.2f}s")
    assert seconds < 60  # seconds, not minutes (about 2s on a laptop core)


def test_blank_text_cells_and_odd_header_columns(api, ds):
    text = "email,note,{{tag}},,first name\nann@example.com,   ,x,y,Ann\n"
    record = get_import(api, ds, import_csv(api, ds, text)["id"])
    assert record["inserted"] == "1" and record["skipped"] == "0"
    assert record["errors"] == [{"row": "1", "error": "column '{{tag}}' left out: a field name "
                                                      "is one line without braces, at most "
                                                      "200 characters"}]
    fields = recipients(api, ds)["ann@example.com"]["fields"]
    assert fields["note"] is None and fields["first name"] == "Ann"
    assert "{{tag}}" not in fields and "" not in fields
    renamed = api.get(f"/datasource/{ds}/modify/first%20name", new="given name", type="text")
    assert renamed["field"]["name"] == "given name"
    assert recipients(api, ds)["ann@example.com"]["fields"]["given name"] == "Ann"
