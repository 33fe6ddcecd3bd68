"""Campaign records: the spec's emt_campaign record field for field, create at
a chosen id, change, soft delete, account isolation."""

import datetime
import re

import campaignapi

RECORD_KEYS = {"id", "owner", "accountprofile", "name", "description", "enabled", "scheduled",
               "archiveemail", "defaulttemplate", "created", "deleted", "thumbnail", "archiveid",
               "tracking", "testsize", "testmetric", "testwait", "public"}


def campaign(api, campaign_id):
    data = api.get(f"/campaign/{campaign_id}")
    assert set(data) == {"emt_campaign"} and len(data["emt_campaign"]) == 1
    return data["emt_campaign"][0]


def test_record_field_for_field(api):
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0, tzinfo=None)
    assert api.put("/campaign/0", name="Spring sale", accountprofile=3) == {"id": "1"}
    after = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)
    record = campaign(api, 1)
    assert set(record) == RECORD_KEYS
    assert record == {**record, "id": "1", "accountprofile": "3", "name": "Spring sale",
                      "description": "", "enabled": "1", "scheduled": "0", "archiveemail": None,
                      "defaulttemplate": "", "deleted": "0", "thumbnail": None, "archiveid": "1",
                      "tracking": "0", "testsize": "20", "testmetric": "opens",
                      "testwait": "14400"}
    assert re.fullmatch(r"\d+", record["owner"])
    for key, value in record.items():
        assert isinstance(value, str) or (value is None and key in ("archiveemail", "thumbnail"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", record["created"])
    created = datetime.datetime.strptime(record["created"], "%Y-%m-%d %H:%M:%S")
    assert before <= created <= after          # UTC, not local time


def test_create_with_every_optional_field(api):
    api.put("/template/3", html="<div>{{content}}</div>")  # a template must exist (issue 14)
    api.put("/campaign/0", name="Full", accountprofile="12", description="About\nit",
            enabled="0", archiveemail=" Archive@Example.COM ", defaulttemplate="3",
            thumbnail="thumb.png")
    record = campaign(api, 1)
    assert record == {**record, "accountprofile": "12", "description": "About\nit",
                      "enabled": "0", "archiveemail": "Archive@example.com",
                      "defaulttemplate": "3", "thumbnail": "thumb.png"}


def test_all_lists_every_live_campaign_as_an_array(api):
    for number in range(3):
        api.put("/campaign/0", name=f"c{number}", accountprofile=1)
    api.delete("/campaign/2")
    data = api.get("/campaign/all")
    assert [c["name"] for c in data["emt_campaign"]] == ["c0", "c2"]
    assert all(set(c) == RECORD_KEYS for c in data["emt_campaign"])
    assert (data["total"], data["limit"], data["offset"]) == ("2", "100", "0")


def test_create_at_a_chosen_id_and_409_when_taken(api, stranger_api, db):
    assert api.put("/campaign/500", name="x", accountprofile=1) == {"id": "500"}
    assert campaign(api, 500)["archiveid"] == "500"
    assert api.put("/campaign/500", status=409, name="y", accountprofile=1)["error"] == "conflict"
    assert stranger_api.put("/campaign/500", status=409, name="z", accountprofile=1)["error"] \
        == "conflict"
    assert campaign(api, 500)["name"] == "x"
    assert api.put("/campaign/0", name="next", accountprofile=1) == {"id": "501"}


def test_change_a_campaign(api):
    api.put("/campaign/0", name="x", accountprofile=1, archiveemail="a@example.com",
            thumbnail="t.png")
    api.put("/template/7", text="{{content}}")
    assert api.post("/campaign/1", name="renamed", accountprofile=2, description="d",
                    enabled=False, archiveemail="", defaulttemplate="7", thumbnail="") is True
    record = campaign(api, 1)
    assert record == {**record, "name": "renamed", "accountprofile": "2", "description": "d",
                      "enabled": "0", "archiveemail": None, "defaulttemplate": "7",
                      "thumbnail": None}
    assert api.post("/campaign/1") is True
    assert campaign(api, 1) == record


def test_change_scheduled(api):
    api.put("/campaign/0", name="x", accountprofile=1)
    assert api.post("/campaign/1", scheduled="0") is True
    data = api.post("/campaign/1", status=400, scheduled="1")
    assert data["error"] == "invalid_parameter" and data["field"] == "scheduled"
    assert campaign(api, 1)["scheduled"] == "0"


def test_scheduled_is_derived_from_batches(api, db):
    api.put("/campaign/0", name="x", accountprofile=1)
    conn = campaignapi.connect(db)
    # Every other column the schema says must be given: a time.
    values = {"campaign": 1, "status": "scheduled", "timestamp": "2030-01-01 00:00:00"}
    conn.execute(f"INSERT INTO batch ({', '.join(values)}) VALUES "
                 f"({', '.join('?' for _ in values)})", tuple(values.values()))
    conn.close()
    assert campaign(api, 1)["scheduled"] == "1"
    assert api.post("/campaign/1", scheduled=0) is True      # cancels the waiting batch
    assert campaign(api, 1)["scheduled"] == "0"


def test_change_with_one_bad_parameter_changes_nothing(api):
    api.put("/campaign/0", name="x", accountprofile=1)
    before = campaign(api, 1)
    data = api.post("/campaign/1", status=400, name="new", enabled="maybe")
    assert data["field"] == "enabled"
    data = api.post("/campaign/1", status=400, name="new", archiveemail="nope")
    assert data["field"] == "archiveemail"
    assert api.post("/campaign/1", status=400, name="new", owner=2)["error"] == "unknown_parameter"
    assert campaign(api, 1) == before


def test_soft_delete(api, db):
    api.put("/campaign/0", name="gone", accountprofile=1)
    assert api.delete("/campaign/1") is True
    record = campaign(api, 1)
    assert record["deleted"] == "1" and record["name"] == "gone"
    assert api.get("/campaign/all")["emt_campaign"] == []
    assert api.post("/campaign/1", status=409, name="back")["error"] == "conflict"
    assert api.delete("/campaign/1", status=409)["error"] == "conflict"
    conn = campaignapi.connect(db)
    assert conn.execute("SELECT count(*) FROM campaign").fetchone()[0] == 1
    conn.close()


def test_unknown_campaign_is_404(api):
    assert api.get("/campaign/3", status=404)["error"] == "not_found"
    assert api.post("/campaign/3", status=404, name="x")["error"] == "not_found"
    assert api.delete("/campaign/3", status=404)["error"] == "not_found"


def test_other_accounts_campaigns_are_invisible(api, stranger_api):
    api.put("/campaign/0", name="mine", accountprofile=1)
    stranger_api.put("/campaign/0", name="theirs", accountprofile=1)
    assert api.get("/campaign/2", status=404)["error"] == "not_found"
    assert api.post("/campaign/2", status=404, name="hijack")["error"] == "not_found"
    assert api.delete("/campaign/2", status=404)["error"] == "not_found"
    assert [c["name"] for c in api.get("/campaign/all")["emt_campaign"]] == ["mine"]
    assert [c["name"] for c in stranger_api.get("/campaign/all")["emt_campaign"]] == ["theirs"]
    assert campaign(stranger_api, 2)["name"] == "theirs"
    assert campaign(stranger_api, 2)["deleted"] == "0"
