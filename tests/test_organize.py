"""Organize records: a datasource in a folder at a sort position."""

import pytest

from helpers import make_datasource


@pytest.fixture
def ds(api):
    return make_datasource(api)


def test_create_get_change(api, ds):
    assert api.put(f"/datasource/{ds}/organize/0", item=ds, folder="Clients/2024",
                   sortorder=3) == {"id": "1"}
    record = api.get(f"/datasource/{ds}/organize/1")["organize"]
    assert record == {"id": "1", "item": str(ds), "folder": "Clients/2024", "sortorder": "3"}
    page = api.get(f"/datasource/{ds}/organize/all")
    assert page["organize"] == [record] and page["total"] == "1"
    # Spec rule 4: the datasource in the path names the record; {child_id} does not.
    assert api.post(f"/datasource/{ds}/organize/0", id=1, folder="", sortorder=9) is True
    assert api.get(f"/datasource/{ds}/organize/1")["organize"] == \
        {"id": "1", "item": str(ds), "folder": "", "sortorder": "9"}
    assert api.post(f"/datasource/{ds}/organize/1", id=1, sortorder=2) is True
    assert api.get(f"/datasource/{ds}/organize/1")["organize"]["folder"] == ""


def test_create_rules(api, ds):
    other = make_datasource(api, "other")
    assert api.put(f"/datasource/{ds}/organize/0", status=409, item=other, folder="",
                   sortorder=0)["field"] == "item"
    assert api.put(f"/datasource/{ds}/organize/0", status=400, item=ds,
                   folder="")["error"] == "missing_parameter"
    assert api.put(f"/datasource/{ds}/organize/5", item=ds, folder="", sortorder=0) == {"id": "5"}
    # At most one per datasource; a taken id is 409 too.
    api.put(f"/datasource/{ds}/organize/0", status=409, item=ds, folder="x", sortorder=1)
    api.put(f"/datasource/{other}/organize/5", status=409, item=other, folder="", sortorder=0)
    api.get(f"/datasource/{other}/organize/5", status=404)
    assert api.get(f"/datasource/{other}/organize/all")["organize"] == []
    assert api.put(f"/datasource/all/organize/0", status=400, item=ds, folder="",
                   sortorder=0)["error"] == "invalid_identifier"


def test_change_rules(api, ds):
    api.post(f"/datasource/{ds}/organize/1", status=404, id=1, folder="x")
    api.put(f"/datasource/{ds}/organize/0", item=ds, folder="a", sortorder=1)
    assert api.post(f"/datasource/{ds}/organize/1", status=409, id=2,
                    folder="x")["field"] == "id"
    assert api.post(f"/datasource/{ds}/organize/1", status=400,
                    folder="x")["error"] == "missing_parameter"
    api.post(f"/datasource/{ds}/organize/1", status=400, id=1, folder="a\nb")


def test_deleted_datasource(api, ds):
    api.put(f"/datasource/{ds}/organize/0", item=ds, folder="a", sortorder=1)
    other = make_datasource(api, "other")
    api.delete(f"/datasource/{ds}", id=ds)
    api.delete(f"/datasource/{other}", id=other)
    assert api.get(f"/datasource/{ds}/organize/1")["organize"]["folder"] == "a"
    api.post(f"/datasource/{ds}/organize/1", status=409, id=1, folder="b")
    api.put(f"/datasource/{other}/organize/0", status=409, item=other, folder="", sortorder=0)
