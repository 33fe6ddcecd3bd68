"""Datasource records: get/create/change/delete, `all` and `import`, create at
a chosen id, soft delete, the email field, account isolation."""

import re

import pytest

import campaignapi


def count(db, table):
    conn = campaignapi.connect(db)
    try:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        conn.close()


def test_create_and_get_a_datasource(api):
    assert api.put("/datasource/0", name="Newsletter", description="Monthly\nletter",
                   origin="signup", fields=[{"name": "First name", "type": "text"},
                                            {"name": "age", "type": "integer"}]) == {"id": "1"}
    record = api.get("/datasource/1")["datasource"]
    assert set(record) == {"id", "owner", "name", "description", "origin", "fields", "recipients",
                           "created", "deleted", "signup", "doubleoptin", "confirmmessage",
                           "welcomemessage", "fromprofile", "language"}
    assert record["id"] == "1" and record["name"] == "Newsletter"
    assert record["description"] == "Monthly\nletter" and record["origin"] == "signup"
    assert record["recipients"] == "0" and record["deleted"] == "0"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", record["created"])
    assert [(f["name"], f["type"]) for f in record["fields"]] == [
        ("email", "email"), ("First name", "text"), ("age", "integer")]
    assert all(isinstance(f["id"], str) for f in record["fields"])
    assert isinstance(record["owner"], str)


def test_defaults_and_the_email_field_always_present(api):
    api.put("/datasource/0", name="Plain")
    record = api.get("/datasource/1")["datasource"]
    assert record["origin"] == "api" and record["description"] == ""
    assert [(f["name"], f["type"]) for f in record["fields"]] == [("email", "email")]


def test_naming_the_email_field_is_allowed(api):
    api.put("/datasource/0", name="d", fields=[{"name": "Email", "type": "email"},
                                              {"name": "city"}])
    fields = api.get("/datasource/1")["datasource"]["fields"]
    assert [(f["name"], f["type"]) for f in fields] == [("email", "email"), ("city", "text")]


@pytest.mark.parametrize("fields", [
    [{"name": "email", "type": "text"}], [{"name": "x", "type": "blob"}], [{"type": "text"}],
    [{"name": ""}], [{"name": "a\nb"}], [{"name": "{{x}}"}], ["x"], [{"name": 5}],
    [{"name": "x", "type": "text", "extra": 1}], [{"name": "ok"}, {"name": "x" * 201}],
])
def test_bad_fields_create_nothing(api, db, fields):
    data = api.put("/datasource/0", status=400, name="d", fields=fields)
    assert data["error"] == "invalid_parameter" and data["field"] == "fields"
    assert count(db, "datasource") == 0 and count(db, "field") == 0
    assert api.put("/datasource/0", name="d") == {"id": "1"}


def test_create_at_a_chosen_free_id_and_409_when_taken(api, stranger_api, db):
    assert api.put("/datasource/42", name="chosen") == {"id": "42"}
    assert api.get("/datasource/42")["datasource"]["name"] == "chosen"
    assert api.put("/datasource/42", status=409, name="again")["error"] == "conflict"
    # Ids are global: another account cannot create at a taken id either.
    assert stranger_api.put("/datasource/42", status=409, name="mine")["error"] == "conflict"
    assert api.put("/datasource/0", name="next") == {"id": "43"}
    assert count(db, "datasource") == 2


def test_change_a_datasource(api):
    api.put("/datasource/0", name="d", fields=[{"name": "age", "type": "integer"}])
    assert api.post("/datasource/1", name="renamed", description="new", origin="import",
                    fields=[{"name": "age", "type": "integer"}, {"name": "city"}]) is True
    record = api.get("/datasource/1")["datasource"]
    assert (record["name"], record["description"], record["origin"]) == ("renamed", "new", "import")
    assert [f["name"] for f in record["fields"]] == ["email", "age", "city"]
    assert api.post("/datasource/1") is True       # nothing to change is fine
    assert api.get("/datasource/1")["datasource"] == record


def test_change_with_one_bad_parameter_changes_nothing(api):
    api.put("/datasource/0", name="d", fields=[{"name": "age", "type": "integer"}])
    before = api.get("/datasource/1")["datasource"]
    assert api.post("/datasource/1", status=400, name="new", origin="mars")["field"] == "origin"
    # A failure after the name was written: the field exists with another type.
    data = api.post("/datasource/1", status=409, name="new",
                    fields=[{"name": "city"}, {"name": "AGE", "type": "text"}])
    assert data["error"] == "conflict"
    assert api.get("/datasource/1")["datasource"] == before


def test_soft_delete(api):
    api.put("/datasource/0", name="keep")
    api.put("/datasource/0", name="drop")
    assert api.delete("/datasource/2", id=2) is True
    record = api.get("/datasource/2")["datasource"]
    assert record["deleted"] == "1" and record["name"] == "drop"
    listing = api.get("/datasource/all")
    assert [d["id"] for d in listing["datasource"]] == ["1"] and listing["total"] == "1"
    assert api.post("/datasource/2", status=409, name="x")["error"] == "conflict"
    assert api.delete("/datasource/2", status=409, id=2)["error"] == "conflict"
    assert api.put("/datasource/2", status=409, name="x")["error"] == "conflict"


def test_delete_needs_the_same_id(api):
    api.put("/datasource/0", name="d")
    assert api.delete("/datasource/1", status=400)["error"] == "missing_parameter"
    assert api.delete("/datasource/1", status=409, id=2)["field"] == "id"
    assert api.delete("/datasource/1", status=400, id="one")["field"] == "id"
    assert api.get("/datasource/1")["datasource"]["deleted"] == "0"
    assert api.delete("/datasource/1", id="1") is True


def test_import_selector_lists_imported_datasources(api):
    api.put("/datasource/0", name="a", origin="import")
    api.put("/datasource/0", name="b")
    api.put("/datasource/0", name="c", origin="import")
    api.put("/datasource/0", name="d", origin="import")
    api.delete("/datasource/4", id=4)
    data = api.get("/datasource/import")
    assert [d["name"] for d in data["datasource"]] == ["a", "c"]
    assert data["total"] == "2"
    page = api.get("/datasource/import", limit=1, offset=1)
    assert [d["name"] for d in page["datasource"]] == ["c"] and page["total"] == "2"


def test_unknown_datasource_is_404(api):
    assert api.get("/datasource/9", status=404)["error"] == "not_found"
    assert api.post("/datasource/9", status=404, name="x")["error"] == "not_found"
    assert api.delete("/datasource/9", status=404, id=9)["error"] == "not_found"


def test_other_accounts_datasources_are_invisible(api, stranger_api):
    api.put("/datasource/0", name="mine")
    stranger_api.put("/datasource/0", name="theirs")
    for path in ("/datasource/2",):
        assert api.get(path, status=404)["error"] == "not_found"
        assert api.post(path, status=404, name="hijack")["error"] == "not_found"
        assert api.delete(path, status=404, id=2)["error"] == "not_found"
    assert [d["name"] for d in api.get("/datasource/all")["datasource"]] == ["mine"]
    assert [d["name"] for d in stranger_api.get("/datasource/all")["datasource"]] == ["theirs"]
    assert stranger_api.get("/datasource/2")["datasource"]["name"] == "theirs"
    assert stranger_api.get("/datasource/2")["datasource"]["deleted"] == "0"
    assert api.get("/datasource/all")["datasource"][0]["owner"] != \
        stranger_api.get("/datasource/all")["datasource"][0]["owner"]
