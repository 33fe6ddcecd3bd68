"""Exports: the CSV, its record, the notification, the download link."""

import csv
import io
import os

import pytest
import webtest

import campaignapi
from helpers import database, import_csv, make_datasource, make_signup_list, recipients, scalar


@pytest.fixture
def ds(api, db):
    ds = make_datasource(api, "Customers", fields=[{"name": "score", "type": "number"}])
    import_csv(api, ds, 'email,name,score\n'
                        'ann@example.com,"Ann, ""the"" first",1.0\n'
                        'bob@example.com,"two\nlines",2.5\n'
                        'cid@example.com,Cid,\n')
    with database(db) as conn:
        conn.execute("UPDATE recipient SET status = 'unsubscribed' WHERE email = 'cid@example.com'")
    return ds


def _path(url):
    return url.split("http://localhost:80", 1)[1]


def test_export_record_file_and_notification(api, ds, db, client):
    record = api.get(f"/datasource/{ds}/export/0")["export"]
    assert set(record) == {"id", "datasource", "status", "rows", "url", "expires", "created",
                           "finished"}
    assert (record["datasource"], record["status"], record["rows"]) == (str(ds), "finished", "2")
    assert record["url"].startswith("http://localhost:80/v1/download/")
    assert len(record["url"].rsplit("/", 1)[1]) >= 43  # 32 random bytes, base64
    assert record["expires"] > record["created"] and record["finished"]
    assert api.get(f"/datasource/{ds}/export/{record['id']}")["export"] == record

    response = client.get(_path(record["url"]))  # no Authorization header
    assert response.status_int == 200
    assert response.content_type == "text/csv"
    assert response.headers["Content-Disposition"] == \
        f'attachment; filename="datasource-{ds}-export-{record["id"]}.csv"'
    rows = list(csv.reader(io.StringIO(response.body.decode("utf-8"), newline="")))
    # Active recipients only; header email then the fields.
    assert rows == [["email", "score", "name"],
                    ["ann@example.com", "1", 'Ann, "the" first'],
                    ["bob@example.com", "2.5", "two\nlines"]]

    with database(db) as conn:
        mail = conn.execute("SELECT * FROM outbox WHERE subject LIKE 'Export%'").fetchall()
    assert len(mail) == 1
    assert mail[0]["to_addr"] == "owner@example.com" and mail[0]["kind"] == "notification"
    assert mail[0]["subject"] == 'Export of "Customers" is ready'
    assert record["url"] in mail[0]["body"]
    # The file lives beside the database on SQLite (README: ``<db>-exports/``), whole.
    folder = os.path.dirname(scalar(db, "SELECT path FROM export WHERE id = ?", int(record["id"])))
    if not db.startswith("postgresql"):
        assert folder == os.path.abspath(db) + "-exports"
    assert os.listdir(folder) and not any(name.endswith(".part") for name in os.listdir(folder))


def test_export_reimports(api, ds, client):
    url = api.get(f"/datasource/{ds}/export/0")["export"]["url"]
    body = client.get(_path(url)).body.decode("utf-8")
    copy = make_datasource(api, "copy")
    record = api.get(f"/datasource/{copy}/import/{import_csv(api, copy, body)['id']}")["import"]
    assert (record["inserted"], record["skipped"]) == ("2", "0")


def test_download_fails_once_expired_or_unknown(api, ds, db, client):
    record = api.get(f"/datasource/{ds}/export/0")["export"]
    path = _path(record["url"])
    assert client.get(path).status_int == 200
    with database(db) as conn:
        conn.execute("UPDATE export SET expires = '2000-01-01 00:00:00' WHERE id = ?",
                     (int(record["id"]),))
        old = conn.execute("SELECT path FROM export WHERE id = ?",
                           (int(record["id"]),)).fetchone()[0]
    response = client.get(path, expect_errors=True)
    assert response.status_int == 404
    assert response.json["success"] is False and response.json["data"]["error"] == "not_found"
    assert api.get(f"/datasource/{ds}/export/{record['id']}")["export"]["url"] is None
    assert client.get("/v1/download/nosuchtoken", expect_errors=True).status_int == 404
    # The next export clears expired files away.
    api.get(f"/datasource/{ds}/export/0")
    with database(db) as conn:
        assert conn.execute("SELECT path FROM export WHERE id = ?",
                            (int(record["id"]),)).fetchone()[0] is None
    assert not os.path.exists(old) and os.listdir(os.path.dirname(old))


def test_public_url_in_links(db, make_key):
    app = campaignapi.create_app(db, public_url="https://mail.example.net/api/")
    client = webtest.TestApp(app)
    headers = make_key()
    client.put_json("/v1/datasource/0", {"name": "x"}, headers=headers)
    record = client.get("/v1/datasource/1/export/0", headers=headers).json["data"]["export"]
    assert record["url"].startswith("https://mail.example.net/api/v1/download/")


def test_export_ids_and_deleted_datasource(api, ds):
    other = make_datasource(api, "other")
    first = api.get(f"/datasource/{ds}/export/0")["export"]["id"]
    api.get(f"/datasource/{other}/export/{first}", status=404)
    api.get(f"/datasource/{ds}/export/999", status=404)
    assert api.get(f"/datasource/{ds}/export/all", status=400)["error"] == "invalid_identifier"
    api.delete(f"/datasource/{ds}", id=ds)
    assert api.get(f"/datasource/{ds}/export/{first}")["export"]["status"] == "finished"
    api.get(f"/datasource/{ds}/export/0", status=409)


def test_empty_datasource_exports_a_header(api, client):
    ds = make_datasource(api, fields=[{"name": "city", "type": "text"}])
    record = api.get(f"/datasource/{ds}/export/0")["export"]
    assert record["rows"] == "0"
    assert client.get(_path(record["url"])).body == b"email,city\r\n"


def exported(api, client, ds):
    """The rows of a new export of ``ds``, downloaded by its link, parsed by csv."""
    url = api.get(f"/datasource/{ds}/export/0")["export"]["url"]
    text = client.get(_path(url)).body.decode("utf-8")
    return list(csv.reader(io.StringIO(text, newline="")))


def test_text_cells_never_start_a_formula(api, client):
    """OWASP's CSV injection: a text cell (the email column and text fields)
    that starts with = + - @ tab or CR gets a leading '; numbers, dates and
    flags print as their type does."""
    ds = make_signup_list(api, doubleoptin=0, fields=[
        {"name": "first", "type": "text"}, {"name": "n", "type": "integer"},
        {"name": "x", "type": "number"}, {"name": "d", "type": "date"},
        {"name": "b", "type": "boolean"}])
    import_csv(api, ds, "email,first,n,x,d,b\n"
                        "-ann@example.com,\"=cmd|' /C calc'!A0\",-5,-2.5,2020-01-02,1\n"
                        'bob@example.com,"\t=1+1",,,,0\n'
                        'cid@example.com,"\r=2",7,,,\n'
                        "eve@example.com,plain - text,0,+1.5,,\n")
    for values in ({"email": "=1+2@example.com", "first": "@SUM(1+1)"},
                   {"email": "+1+1@example.com", "first": "+1+1"}):
        assert client.post(f"/v1/subscribe/{ds}", values).status_int == 200
    assert exported(api, client, ds) == [
        ["email", "first", "n", "x", "d", "b"],
        ["'-ann@example.com", "'=cmd|' /C calc'!A0", "-5", "-2.5", "2020-01-02", "1"],
        ["bob@example.com", "'\t=1+1", "", "", "", "0"],
        ["cid@example.com", "'\r=2", "7", "", "", ""],
        ["eve@example.com", "plain - text", "0", "1.5", "", ""],
        ["'=1+2@example.com", "'@SUM(1+1)", "", "", "", ""],
        ["'+1+1@example.com", "'+1+1", "", "", "", ""]]
    # The records keep what was typed; only the file for people changes.
    assert {"-ann@example.com", "=1+2@example.com"} <= set(recipients(api, ds))


def test_a_field_of_type_email_is_a_column_of_its_own(api, client):
    ds = make_datasource(api, fields=[{"name": "work", "type": "email"}])
    import_csv(api, ds, "email,work\nann@example.com,=w@example.com\n"
                        "bob@example.com,bob@work.example\n")
    assert exported(api, client, ds) == [["email", "work"],
                                         ["ann@example.com", "'=w@example.com"],
                                         ["bob@example.com", "bob@work.example"]]
