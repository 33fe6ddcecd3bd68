"""Values that the two engines would treat differently are refused alike on
both: a NUL character in an imported cell skips its row (PostgreSQL's jsonb
cannot hold one), and a segment over the datasource still counts."""

from helpers import get_import, import_csv, make_datasource


def test_a_nul_in_a_cell_skips_the_row_and_segments_still_count(api):
    ds = make_datasource(api, fields=[{"name": "name", "type": "text"}])
    report = import_csv(api, ds, "email,name\nann@example.com,A\x00nn\nbob@example.com,Bob\n",
                        uploadtype="base64")
    record = get_import(api, ds, report["id"])
    assert (record["inserted"], record["skipped"]) == ("1", "1")
    assert "NUL" in record["errors"][0]["error"]
    segment = api.put("/segment/0", name="s", datasources=[ds],
                      conditions=[{"field": "name", "op": "contains", "value": "o"}])["id"]
    assert api.get(f"/segment/{segment}")["segment"]["size"] == "1"


def test_a_nul_in_a_json_value_skips_the_row(api):
    ds = make_datasource(api, fields=[{"name": "name", "type": "text"}])
    report = api.put(f"/datasource/{ds}/import/0", name="j", originalfile="j.json",
                     __uploadtype__="json", __uploaddata__=[
                         {"email": "ann@example.com", "name": "A\x00nn"},
                         {"email": "bob@example.com", "name": "Bob"}])
    record = get_import(api, ds, report["id"])
    assert (record["inserted"], record["skipped"]) == ("1", "1")
