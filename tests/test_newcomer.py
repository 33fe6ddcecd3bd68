"""Small things a newcomer tripped on: typo'd keys of skipped rows, a
spreadsheet sent as base64, the page size's range, the API's index."""

import io
import zipfile

import campaignapi
from helpers import get_import, import_csv, make_datasource


def field_names(api, ds):
    return [field["name"] for field in api.get(f"/datasource/{ds}")["datasource"]["fields"]]


def test_a_key_of_skipped_json_rows_only_adds_no_field(api):
    ds = make_datasource(api)
    rows = [{"mail": "typo@example.com", "city": "Oslo"}, {"email": "ann@example.com"}]
    done = api.put(f"/datasource/{ds}/import/0", name="j", originalfile="j.json",
                   __uploadtype__="json", __uploaddata__=rows)
    record = get_import(api, ds, done["id"])
    assert (record["inserted"], record["skipped"]) == ("1", "1")
    assert field_names(api, ds) == ["email"]
    # A key that a stored row has is made a field, once, with the row's value.
    rows = [{"email": "bob@example.com", "city": "Bergen"}, {"mail": "x", "city": "Oslo"},
            {"email": "cy@example.com", "city": "Rome"}]
    api.put(f"/datasource/{ds}/import/0", name="j2", originalfile="j.json",
            __uploadtype__="json", __uploaddata__=rows)
    assert field_names(api, ds) == ["email", "city"]
    page = api.get(f"/datasource/{ds}/recipient/all")["recipient"]
    assert {r["email"]: r["fields"].get("city") for r in page} == {
        "ann@example.com": None, "bob@example.com": "Bergen", "cy@example.com": "Rome"}


def test_columns_of_a_csv_whose_rows_are_all_skipped_add_no_field(api):
    ds = make_datasource(api)
    record = import_csv(api, ds, "email,city\nnot-an-address,Oslo\n,Rome\n")
    assert get_import(api, ds, record["id"])["skipped"] == "2"
    assert field_names(api, ds) == ["email"]
    import_csv(api, ds, "email,city\nnot-an-address,Oslo\nann@example.com,Rome\n")
    assert field_names(api, ds) == ["email", "city"]


def test_a_spreadsheet_sent_as_base64_is_not_csv_text(api):
    ds = make_datasource(api)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as book:
        book.writestr("[Content_Types].xml", "<Types/>")
        book.writestr("xl/worksheets/sheet1.xml", "<worksheet/>")
    data = import_csv(api, ds, buffer.getvalue(), status=422, uploadtype="base64")
    assert data["error"] == "invalid_data"
    assert data["message"].startswith("The upload is not CSV text (a ZIP file")
    assert "email column" not in data["message"]
    assert api.get(f"/datasource/{ds}/import/all")["total"] == "0"
    # UTF-16 text has NUL bytes too, and is still read.
    text = "email\nann@example.com\n"
    record = import_csv(api, ds, text, uploadtype="base64", encoding="utf-16")
    assert get_import(api, ds, record["id"])["inserted"] == "1"


def test_the_page_size_names_its_range(api):
    for value in ("-1", "0", "1001", 5000):
        data = api.get("/campaign/all", status=400, limit=value)
        assert data["message"] == "'limit' must be a whole number from 1 to 1000."
        assert data["field"] == "limit"
    assert api.get("/campaign/all", limit="1000")["limit"] == "1000"


def test_the_index_names_the_version_the_document_and_the_collections(client, auth):
    data = client.get("/v1/").json["data"]      # no key needed
    assert data["version"] == campaignapi.__version__
    # Links are relative to the index's URL: they hold under a mount prefix.
    assert data["openapi"] == "openapi.json"
    assert client.get("/v1/" + data["openapi"]).json["openapi"].startswith("3.1")
    assert data["collections"]["campaign"] == "campaign/all"
    for link in data["collections"].values():
        assert client.get("/v1/" + link, headers=auth).json["success"]
    root = client.get("/", status=302)
    assert root.headers["Location"] == "http://localhost:80/v1/"
    assert client.get("/v1/").json["data"] == data
    client.post("/", status=404)   # only GET is redirected
