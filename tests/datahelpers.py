"""Helpers shared by the recipient-data tests (imports, exports, organize)."""

import base64
import contextlib

import campaignapi


def make_datasource(api, name="list", fields=()):
    """A new datasource of the api's account; its id (int)."""
    return int(api.put("/datasource/0", name=name, fields=list(fields))["id"])


def import_csv(api, ds, text, status=200, uploadtype="csv", encoding="utf-8", name="import"):
    """Import CSV text (as csv, or as base64 of ``text`` encoded in ``encoding``)."""
    data = text if uploadtype == "csv" else base64.b64encode(
        text if isinstance(text, bytes) else text.encode(encoding)).decode("ascii")
    return api.put(f"/datasource/{ds}/import/0", status=status, name=name,
                   originalfile="people.csv", __uploadtype__=uploadtype, __uploaddata__=data)


def get_import(api, ds, import_id):
    return api.get(f"/datasource/{ds}/import/{import_id}")["import"]


def recipients(api, ds, **params):
    """Every recipient of the datasource as {email: record}."""
    page = api.get(f"/datasource/{ds}/recipient/all", limit=1000, **params)
    return {record["email"]: record for record in page["recipient"]}


@contextlib.contextmanager
def database(db):
    conn = campaignapi.connect(db)
    try:
        yield conn
    finally:
        conn.close()


def count(db, sql, *args):
    with database(db) as conn:
        return conn.execute(sql, args).fetchone()[0]
