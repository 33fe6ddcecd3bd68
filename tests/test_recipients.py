"""Recipients, field changes, and a foreign account's view of every
datasource sub-resource route."""

import json

import pytest

import campaignapi
from helpers import database, import_csv, make_datasource, recipients, scalar


@pytest.fixture
def ds(api):
    ds = make_datasource(api, fields=[{"name": "age", "type": "text"},
                                      {"name": "score", "type": "number"}])
    import_csv(api, ds, "email,age,score,city\n"
                        "ann@example.com,41,1.5,Rome\n"
                        "bob@example.com,7,2,\n"
                        "cid@example.com,,,Oslo\n")
    return ds


def test_get_one_recipient(api, ds):
    first = api.get(f"/datasource/{ds}/recipient/all")["recipient"][0]
    record = api.get(f"/datasource/{ds}/recipient/{first['id']}")["recipient"]
    assert record == first
    assert set(record) == {"id", "datasource", "email", "fields", "status", "created", "updated"}
    assert record["datasource"] == str(ds) and record["status"] == "active"
    assert record["fields"] == {"email": "ann@example.com", "age": "41", "score": "1.5",
                                "city": "Rome"}
    bob = recipients(api, ds)["bob@example.com"]
    assert bob["fields"]["score"] == "2" and bob["fields"]["city"] is None


def test_paging_and_status_filter(api, ds, db):
    with database(db) as conn:
        conn.execute("UPDATE recipient SET status = 'bounced' WHERE email = 'bob@example.com'")
    page = api.get(f"/datasource/{ds}/recipient/all", limit=2, offset=1)
    assert (page["total"], page["limit"], page["offset"]) == ("3", "2", "1")
    assert [r["email"] for r in page["recipient"]] == ["bob@example.com", "cid@example.com"]
    by_status = {status: [r["email"] for r in api.call(
        "GET", f"/datasource/{ds}/recipient/all", {"status": status})["recipient"]]
        for status in ("active", "bounced", "unsubscribed")}
    assert by_status == {"active": ["ann@example.com", "cid@example.com"],
                         "bounced": ["bob@example.com"], "unsubscribed": []}
    error = api.get(f"/datasource/{ds}/recipient/all?status=gone", status=400)
    assert error["allowed"] == ["active", "unconfirmed", "unsubscribed", "bounced", "complained"]
    assert api.get(f"/datasource/{ds}/recipient/all", status=400, limit=1001)["field"] == "limit"


def test_recipient_ids(api, ds):
    other = make_datasource(api, "other")
    recipient = api.get(f"/datasource/{ds}/recipient/all")["recipient"][0]["id"]
    api.get(f"/datasource/{other}/recipient/{recipient}", status=404)
    api.get(f"/datasource/{ds}/recipient/999", status=404)
    assert api.get(f"/datasource/all/recipient/all", status=400)["error"] == "invalid_identifier"
    assert api.get(f"/datasource/{ds}/recipient/import", status=400)["error"] == \
        "invalid_identifier"


# Field changes --------------------------------------------------------------

def _field(api, ds, name):
    fields = api.get(f"/datasource/{ds}")["datasource"]["fields"]
    return next((f for f in fields if f["name"] == name), None)


def test_rename_by_name_and_by_id(api, ds):
    record = api.get(f"/datasource/{ds}/modify/CITY", new="Town", type="text")["field"]
    assert record == {"id": record["id"], "datasource": str(ds), "name": "Town", "type": "text",
                      "label": ""}
    assert recipients(api, ds)["ann@example.com"]["fields"]["Town"] == "Rome"
    renamed = api.get(f"/datasource/{ds}/modify/{record['id']}", new="town", type="text")
    assert renamed["field"]["name"] == "town"


def test_retype_converts_every_value(api, ds):
    record = api.get(f"/datasource/{ds}/modify/age", new="age", type="integer")["field"]
    assert record["type"] == "integer"
    with database(api.client.app.config["campaignapi.service"].db) as conn:
        stored = [json.loads(row[0]).get(record["id"]) for row in conn.execute(
            "SELECT data FROM recipient ORDER BY id")]
    assert stored == [41, 7, None]
    api.get(f"/datasource/{ds}/modify/score", new="score", type="text")
    people = recipients(api, ds)
    assert people["bob@example.com"]["fields"]["score"] == "2"
    assert people["ann@example.com"]["fields"]["age"] == "41"


def test_retype_failing_halfway_changes_nothing(api, db, monkeypatch):
    # internal: chunks of 50 rows: the failure comes after some were written
    monkeypatch.setattr(campaignapi, "_CHUNK_ROWS", 50)
    ds = make_datasource(api, fields=[{"name": "code", "type": "text"}])
    lines = [f"p{i}@example.com,{i}" for i in range(300)]
    lines[170] = "bad1@example.com,12a"
    lines[250] = "bad2@example.com,x"
    import_csv(api, ds, "email,code\n" + "\n".join(lines) + "\n")
    with database(db) as conn:
        before = conn.execute("SELECT id, data, updated FROM recipient ORDER BY id").fetchall()
    error = api.get(f"/datasource/{ds}/modify/code", status=422, new="number", type="integer")
    assert error["error"] == "invalid_data"
    assert [(r["email"], r["value"]) for r in error["rows"]] == \
        [("bad1@example.com", "12a"), ("bad2@example.com", "x")]
    assert error["rows"][0]["error"] == "'12a' is not a whole number"
    assert error["rows"][0]["recipient"] == str(before[170]["id"])
    with database(db) as conn:
        after = conn.execute("SELECT id, data, updated FROM recipient ORDER BY id").fetchall()
    assert [tuple(r) for r in after] == [tuple(r) for r in before]
    assert _field(api, ds, "code")["type"] == "text" and _field(api, ds, "number") is None


def test_field_change_refusals(api, ds):
    path = f"/datasource/{ds}/modify"
    assert api.get(f"{path}/email", status=409, new="mail", type="email")["error"] == "conflict"
    api.get(f"{path}/email", status=409, new="email", type="text")
    assert api.get(f"{path}/email", new="email", type="email")["field"]["name"] == "email"
    assert api.get(f"{path}/age", status=409, new="City", type="text")["field"] == "new"
    assert api.get(f"{path}/age", status=409, new="EMAIL", type="text")["field"] == "new"
    assert api.get(f"{path}/age", status=400, new="{{age}}", type="text")["field"] == "new"
    assert api.get(f"{path}/age", status=400, new="age", type="money")["field"] == "type"
    assert api.get(f"{path}/age", status=400, new="age")["error"] == "missing_parameter"
    assert api.get(f"{path}/nosuch", status=404, new="x", type="text")["error"] == "not_found"
    api.delete(f"/datasource/{ds}", id=ds)
    api.get(f"{path}/age", status=409, new="years", type="text")


def test_field_change_needs_write_level(client, make_key, ds):
    reader = make_key(levels=("read",))
    response = client.get(f"/v1/datasource/{ds}/modify/age?new=x&type=text", headers=reader,
                          expect_errors=True)
    assert response.status_int == 403


# A foreign account ---------------------------------------------------------

UPLOAD = {"name": "x", "originalfile": "", "__uploadtype__": "csv",
          "__uploaddata__": "email\nintruder@example.com\n"}

FOREIGN_CALLS = [
    ("GET", "/datasource/{ds}/recipient/all", {}),
    ("GET", "/datasource/{ds}/recipient/{recipient}", {}),
    ("PUT", "/datasource/{ds}/recipient/0", {"email": "intruder@example.com"}),
    ("POST", "/datasource/{ds}/recipient/{recipient}", {"email": "intruder@example.com"}),
    ("DELETE", "/datasource/{ds}/recipient/{recipient}", {}),
    ("GET", "/datasource/{ds}/modify/age", {"new": "hacked", "type": "text"}),
    ("GET", "/datasource/{ds}/import/all", {}),
    ("GET", "/datasource/{ds}/import/{import}", {}),
    ("PUT", "/datasource/{ds}/import/0", UPLOAD),
    ("POST", "/datasource/{ds}/import/{import}", {"id": "{import}", "name": "hacked"}),
    ("DELETE", "/datasource/{ds}/import/{import}", {"id": "{import}"}),
    ("GET", "/datasource/{ds}/export/0", {}),
    ("GET", "/datasource/{ds}/export/{export}", {}),
    ("GET", "/datasource/{ds}/organize/all", {}),
    ("GET", "/datasource/{ds}/organize/{organize}", {}),
    ("PUT", "/datasource/{ds}/organize/0", {"item": "{ds}", "folder": "x", "sortorder": 1}),
    ("POST", "/datasource/{ds}/organize/{organize}",
     {"id": "{organize}", "folder": "hacked"}),
]


def test_every_foreign_route_is_covered():
    def operation(method, path):
        return method, path.split("/")[3]
    routes = {operation(r.method, r.path) for r in campaignapi.ROUTES
              if r.path.startswith("/datasource/{parent_id}/")}
    assert routes == {operation(method, path) for method, path, _ in FOREIGN_CALLS}


@pytest.mark.parametrize("method, path, params", FOREIGN_CALLS)
def test_foreign_account_gets_404(api, stranger_api, db, method, path, params):
    ds = make_datasource(api, fields=[{"name": "age", "type": "text"}])
    ids = {"ds": ds, "import": int(import_csv(api, ds, "email,age\na@example.com,1\n")["id"]),
           "export": int(api.get(f"/datasource/{ds}/export/0")["export"]["id"]),
           "organize": int(api.put(f"/datasource/{ds}/organize/0", item=ds, folder="f",
                                   sortorder=1)["id"])}
    ids["recipient"] = int(api.get(f"/datasource/{ds}/recipient/all")["recipient"][0]["id"])

    def fill(value):
        if isinstance(value, str) and value.startswith("{") and value.endswith("}") \
                and value[1:-1] in ids:
            return ids[value[1:-1]]
        return value.format(**ids) if isinstance(value, str) else value

    with database(db) as conn:
        before = [conn.execute(f"SELECT * FROM {table} ORDER BY id").fetchall()
                  for table in ("recipient", "field", "import", "export", "organize", "outbox")]
    error = stranger_api.call(method, fill(path), {k: fill(v) for k, v in params.items()} or None,
                              status=404)
    assert error["error"] == "not_found"
    with database(db) as conn:
        after = [conn.execute(f"SELECT * FROM {table} ORDER BY id").fetchall()
                 for table in ("recipient", "field", "import", "export", "organize", "outbox")]
    assert [[tuple(r) for r in t] for t in after] == [[tuple(r) for r in t] for t in before]
    assert scalar(db, "SELECT count(*) FROM recipient WHERE email LIKE 'intruder%'") == 0
