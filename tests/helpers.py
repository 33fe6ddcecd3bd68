"""Helpers shared by the hardening tests: a world of records of every kind,
snapshots of the whole database, and raw SQL bulk loading."""

import json
import sqlite3

import campaignapi

HTML = "<p>Hi {{first}}</p><p><a href='{{unsubscribe_url}}'>unsubscribe</a></p>"
TEXT = "Hi {{first}}\nUnsubscribe: {{unsubscribe_url}}"


def build_world(api, send=True):
    """One record of every kind for the api's account, all at id 1 when the
    database is fresh: datasource (with a field, recipients, an import, an
    export and an organize record), message, segment, sender profile, and a
    sendable campaign with a campaign message and (``send``) a batch."""
    ds = api.put("/datasource/0", name="customers",
                 fields=[{"name": "first", "type": "text"}])["id"]
    api.put(f"/datasource/{ds}/import/0", name="list", originalfile="list.csv",
            __uploadtype__="csv",
            __uploaddata__="email,first\nann@example.com,Ann\nbob@example.com,Bob\n")
    api.get(f"/datasource/{ds}/export/0")
    api.put(f"/datasource/{ds}/organize/0", item=int(ds), folder="top", sortorder=1)
    profile = api.put("/accountprofile/0", name="Shop", fromname="The Shop",
                      fromaddress="news@shop.example")["id"]
    message = api.put("/message/0", name="Welcome", subject="Hello {{first}}",
                      html=HTML, text=TEXT)["id"]
    segment = api.put("/segment/0", name="all", datasources=[int(ds)])["id"]
    campaign = api.put("/campaign/0", name="Launch", accountprofile=int(profile))["id"]
    api.put(f"/campaign/{campaign}/message/0", segment=int(segment), message=int(message))
    ids = {"datasource": ds, "profile": profile, "message": message, "segment": segment,
           "campaign": campaign}
    if send:
        ids["batch"] = api.put(f"/campaign/{campaign}/send/0",
                               timestamp="2000-01-01 00:00:00")["id"]
    return ids


def snapshot(db, skip=("setting",)):
    """Every row of every table, to compare before and after."""
    conn = sqlite3.connect(db)
    try:
        tables = [row[0] for row in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
        return {table: sorted(conn.execute(f"SELECT * FROM {table}").fetchall(), key=repr)
                for table in tables if table not in skip}
    finally:
        conn.close()


def bulk_recipients(db, datasource, count, domain="bulk.example"):
    """Insert ``count`` active recipients into ``datasource`` by SQL (fast)."""
    conn = campaignapi.connect(db)
    try:
        with campaignapi.transaction(conn):
            conn.execute(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
                "INSERT INTO recipient (datasource, email, created, updated) "
                "SELECT ?, 'r' || i || '@' || ?, '2024-01-01 00:00:00', '2024-01-01 00:00:00' "
                "FROM n", (count, datasource, domain))
    finally:
        conn.close()


def dumps(value):
    return json.dumps(value).encode()
