"""Segments: datasources plus typed conditions, counted in SQL."""


import threading

import pytest

import campaignapi

from helpers import add_recipients, database, wait_for

FIELDS = [{"name": "city", "type": "text"}, {"name": "age", "type": "integer"},
          {"name": "score", "type": "number"}, {"name": "member", "type": "boolean"},
          {"name": "joined", "type": "date"}]


@pytest.fixture
def people(api, db):
    """A datasource of five people with typed fields; answers its id."""
    ds = int(api.put("/datasource/0", name="people", fields=FIELDS)["id"])
    add_recipients(db, ds, [
        ("ann@example.com", {"city": "Berlin", "age": 34, "score": 7.5, "member": 1,
                             "joined": "2023-01-15"}),
        ("bob@example.com", {"city": "Bern", "age": 9, "score": 10, "member": 0,
                             "joined": "2024-06-01"}),
        ("cy@example.com", {"city": "berlin", "age": 10, "member": 1}),
        ("dee@example.com", {"city": "", "age": 71}),
        ("eve@example.com", {}),
    ])
    add_recipients(db, ds, [("gone@example.com", {"city": "Berlin"})], status="unsubscribed")
    add_recipients(db, ds, [("bounce@example.com", {"city": "Berlin"})], status="bounced")
    return ds


def size(api, ds, conditions, match="all", indexed_in=None):
    """The size of a new segment; with ``indexed_in`` (the database), after
    the worker's step has made the indexes of its conditions' fields."""
    new_id = api.put("/segment/0", datasources=[ds], conditions=conditions, match=match)["id"]
    if indexed_in is not None:
        # internal: the worker's step that makes field indexes, run here at once
        campaignapi._index_conditioned_fields(indexed_in, limit=100)
    return int(api.get(f"/segment/{new_id}")["segment"]["size"])


@pytest.mark.parametrize("field, op, value, expected", [
    ("city", "eq", "BERLIN", 2),            # text compares without case
    ("city", "ne", "berlin", 3),            # the blank and the missing values too
    ("city", "contains", "er", 3),
    ("city", "startswith", "bern", 1),
    ("age", "gt", "9", 3),                  # numerically: 10 > 9 though '10' < '9'
    ("age", "lt", 10, 1),
    ("age", "eq", "71", 1),
    ("score", "gt", "7,4", 2),              # a decimal comma is read as a number
    ("member", "eq", "yes", 2),
    ("member", "eq", False, 1),
    ("joined", "lt", "2024-01-01", 1),
    ("city", "empty", None, 2),             # '' and absent
    ("city", "notempty", None, 3),
    ("email", "startswith", "ANN@", 1),
    ("email", "eq", "Eve@example.com", 1),
])
@pytest.mark.parametrize("indexed", [False, True], ids=["scanned", "indexed"])
def test_each_operator_is_typed(api, db, people, field, op, value, expected, indexed):
    """The same sizes whether the field's index is there or not."""
    condition = {"field": field, "op": op} if value is None else \
        {"field": field, "op": op, "value": value}
    assert size(api, people, [condition], indexed_in=db if indexed else None) == expected


def _plan(conn, sql, params):
    """The plan of a statement as one line (it names the indexes it reads)."""
    if conn.engine == "sqlite":
        return " ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, params))
    conn.execute("SET enable_seqscan = off")   # a table this small is scanned
    return " ".join(row[0] for row in conn.execute("EXPLAIN " + sql, params))


def _count_plan(db, segment_id):
    """The plan of a segment's count (names of indexes in it), and the count."""
    with database(db) as conn:
        row = conn.execute("SELECT * FROM segment WHERE id = ?", (int(segment_id),)).fetchone()
        # internal: the WHERE clause a segment's size, verify and sending share
        where, params = campaignapi._segment_query(conn, row)
        sql = f"SELECT count(*) FROM recipient r WHERE {where}"
        return _plan(conn, sql, params), conn.execute(sql, params).fetchone()[0]


def _field_indexes(db):
    with database(db) as conn:
        return sorted(row[0] for row in conn.execute(conn.sql["table_indexes"], ("recipient",))
                      if row[0].startswith("recipient_field_"))


@pytest.mark.parametrize("field, op, value, expected", [
    ("city", "eq", "BERLIN", 2), ("age", "gt", 9, 3), ("joined", "lt", "2024-01-01", 1),
    ("score", "gt", 7.4, 2), ("member", "eq", "yes", 2)])
def test_a_field_condition_reads_the_fields_index(api, db, people, field, op, value, expected):
    """A condition on a field (eq, gt, lt) is read from an index of exactly
    the expression it compares, once the worker's step has made it: the plan
    says so on both engines; before, it reads the datasource's rows."""
    segment = api.put("/segment/0", name="s", datasources=[people],
                      conditions=[{"field": field, "op": op, "value": value}])["id"]
    plan, count = _count_plan(db, segment)
    assert "recipient_field_" not in plan and count == expected, plan
    # internal: the worker's step that makes field indexes, run here at once
    assert campaignapi._index_conditioned_fields(db, limit=100) == 1
    assert _field_indexes(db) == [f"recipient_field_{_field_id(db, people, field)}_"
                                  f"{dict((f['name'], f['type']) for f in FIELDS)[field]}"]
    plan, count = _count_plan(db, segment)
    assert "recipient_field_" in plan and count == expected, plan
    # internal: a second round finds nothing to do
    assert campaignapi._index_conditioned_fields(db, limit=100) == 0


def _field_id(db, ds, name):
    with database(db) as conn:
        return conn.execute("SELECT id FROM field WHERE datasource = ? AND name = ?",
                            (ds, name)).fetchone()[0]


def test_field_indexes_follow_the_segments(api, db, people):
    """An index is made for each field a live segment compares with eq, gt or
    lt (not contains, empty, nor the address), once for two segments, and
    dropped when no live segment needs it: a changed condition, a deleted
    segment."""
    def indexes():
        # internal: the worker's step that makes and drops field indexes
        campaignapi._index_conditioned_fields(db, limit=100)
        return [name.rsplit("_", 2)[1:] for name in _field_indexes(db)]

    city, age = str(_field_id(db, people, "city")), str(_field_id(db, people, "age"))
    other = api.put("/segment/0", name="o", datasources=[people], conditions=[
        {"field": "city", "op": "contains", "value": "er"}, {"field": "email", "op": "eq",
                                                             "value": "ann@example.com"},
        {"field": "age", "op": "empty"}])["id"]
    assert indexes() == []
    one = api.put("/segment/0", name="a", datasources=[people], conditions=[
        {"field": "city", "op": "eq", "value": "Berlin"}])["id"]
    two = api.put("/segment/0", name="b", datasources=[people], match="any", conditions=[
        {"field": "City", "op": "lt", "value": "c"},
        {"field": "age", "op": "gt", "value": 3}])["id"]
    assert sorted(indexes()) == sorted([[city, "text"], [age, "integer"]])
    api.post(f"/segment/{two}", conditions=[{"field": "age", "op": "ne", "value": 3}])
    assert indexes() == [[city, "text"]]
    api.delete(f"/segment/{one}")
    assert indexes() == []
    api.delete(f"/segment/{other}")


def test_match_all_and_any(api, people):
    conditions = [{"field": "city", "op": "eq", "value": "berlin"},
                  {"field": "age", "op": "gt", "value": 30}]
    assert size(api, people, conditions, "all") == 1     # ann
    assert size(api, people, conditions, "any") == 3     # ann, cy, dee
    assert size(api, people, []) == 5                    # every active recipient


def test_an_address_in_two_datasources_counts_once(api, db, people):
    other = int(api.put("/datasource/0", name="shop", fields=[{"name": "city"}])["id"])
    add_recipients(db, other, [("ANN@example.com", {"city": "Berlin"}),
                               ("zed@example.com", {"city": "Berlin"})])
    new_id = api.put("/segment/0", datasources=[people, other],
                     conditions=[{"field": "city", "op": "eq", "value": "berlin"}])["id"]
    record = api.get(f"/segment/{new_id}")["segment"]
    assert record["datasources"] == [str(people), str(other)]
    assert record["size"] == "3"        # ann (in both), cy, zed
    # A condition on a field only one datasource has is false in the other.
    new_id = api.put("/segment/0", datasources=[people, other],
                     conditions=[{"field": "age", "op": "notempty"}])["id"]
    assert api.get(f"/segment/{new_id}")["segment"]["size"] == "4"
    # ... and a missing value is not equal to any value, as in a datasource
    # that has the field: ann is left out of 'people' but in through 'shop'.
    new_id = api.put("/segment/0", datasources=[people, other],
                     conditions=[{"field": "age", "op": "ne", "value": 34}])["id"]
    assert api.get(f"/segment/{new_id}")["segment"]["size"] == "6"


def test_record_and_change(api, people):
    new_id = api.put("/segment/0", name="Berliners", datasources=[people, str(people)],
                     conditions=[{"field": "City", "op": "eq", "value": 7}])["id"]
    record = api.get(f"/segment/{new_id}")["segment"]
    assert record["datasources"] == [str(people)]
    assert record["conditions"] == [{"field": "City", "op": "eq", "value": "7"}]
    assert (record["name"], record["match"], record["size"]) == ("Berliners", "all", "0")
    api.post(f"/segment/{new_id}", conditions=[{"field": "city", "op": "eq", "value": "bern"}])
    assert api.get(f"/segment/{new_id}")["segment"]["size"] == "1"
    api.post(f"/segment/{new_id}", match="any", name="B")
    record = api.get(f"/segment/{new_id}")["segment"]
    assert (record["name"], record["match"], record["size"]) == ("B", "any", "1")
    assert api.get("/segment/all")["segment"][0]["id"] == new_id


@pytest.mark.parametrize("conditions, words", [
    ([{"field": "age", "op": "like", "value": "1"}], "op must be one of"),
    ([{"field": "age", "op": "gt"}], "value must be"),
    ([{"field": "age", "op": "eq", "value": ""}], "use op 'empty'"),
    ([{"field": "age", "op": "eq", "value": ["1"]}], "value must be"),
    ([{"field": "age", "op": "gt", "value": "old"}], "does not fit the integer field 'age'"),
    ([{"field": "joined", "op": "lt", "value": "yesterday"}], "date"),
    ([{"field": "member", "op": "eq", "value": "maybe"}], "yes/no"),
    ([{"field": "height", "op": "gt", "value": "1"}], "no datasource of this segment"),
    ([{"field": "age", "op": "gt", "value": "1", "extra": 1}], "must be an object"),
    (["age > 1"], "must be an object"),
])
def test_bad_conditions_are_refused(api, people, conditions, words):
    # Refusals that depend on the datasources' fields are conflicts (409).
    state = any(w in words for w in ("does not fit", "date", "yes/no", "no datasource"))
    error = api.put("/segment/0", status=409 if state else 400, datasources=[people],
                    conditions=conditions)
    assert error["field"] == "conditions" and words in error["message"]
    assert "conditions[0]" in error["message"]


def test_conditions_are_checked_against_new_datasources(api, people):
    other = api.put("/datasource/0", name="plain")["id"]
    new_id = api.put("/segment/0", datasources=[people],
                     conditions=[{"field": "age", "op": "gt", "value": "1"}])["id"]
    error = api.post(f"/segment/{new_id}", status=409, datasources=[other])
    assert "'age'" in error["message"]
    api.post(f"/segment/{new_id}", datasources=[other], conditions=[])


def test_datasources_are_checked(api, stranger_api, people):
    foreign = stranger_api.put("/datasource/0", name="theirs")["id"]
    assert api.put("/segment/0", status=404, datasources=[foreign])["error"] == "not_found"
    assert api.put("/segment/0", status=400, datasources=["one"])["field"] == "datasources"
    assert api.put("/segment/0", status=400, datasources="1")["field"] == "datasources"
    assert api.put("/segment/0", status=400, match="some")["allowed"] == ["all", "any"]
    gone = api.put("/datasource/0", name="old")["id"]
    api.delete(f"/datasource/{gone}", id=int(gone))
    assert api.put("/segment/0", status=409, datasources=[gone])["error"] == "conflict"


def test_size_leaves_out_deleted_datasources(api, people):
    new_id = api.put("/segment/0", datasources=[people])["id"]
    assert api.get(f"/segment/{new_id}")["segment"]["size"] == "5"
    api.delete(f"/datasource/{people}", id=people)
    assert api.get(f"/segment/{new_id}")["segment"]["size"] == "0"


def test_request_text_never_becomes_sql(api, people, db):
    value = "x'); DROP TABLE recipient; --"
    assert size(api, people, [{"field": "city", "op": "contains", "value": value}]) == 0
    assert size(api, people, [{"field": "city", "op": "eq", "value": "%"}]) == 0
    assert size(api, people, [{"field": "city", "op": "startswith", "value": "_"}]) == 0
    conn = campaignapi.connect(db)
    assert conn.execute("SELECT count(*) FROM recipient").fetchone()[0] == 7
    conn.close()


def test_segment_soft_delete_and_ownership(api, stranger_api, people):
    new_id = api.put("/segment/0", datasources=[people])["id"]
    stranger_api.get(f"/segment/{new_id}", status=404)
    stranger_api.post(f"/segment/{new_id}", status=404, name="x")
    api.delete(f"/segment/{new_id}")
    assert api.get(f"/segment/{new_id}")["segment"]["deleted"] == "1"
    api.post(f"/segment/{new_id}", status=409, name="x")


def test_the_worker_makes_the_index_of_a_new_condition(api, db, people, monkeypatch):
    """run_worker() makes a field's index once a segment compares the field
    (its first look is at its start), and drops it when none does."""
    stop = threading.Event()
    worker = threading.Thread(target=campaignapi.run_worker, args=(db, stop),
                              kwargs={"interval": 0.05})
    # internal: the worker's step looks for indexes to make every 10 s, here more often
    step, = [step for step in campaignapi._WORKER_STEPS if step.thread == "indexes"]
    monkeypatch.setattr(step, "every", 0.05)
    try:
        segment = api.put("/segment/0", name="s", datasources=[people],
                          conditions=[{"field": "city", "op": "eq", "value": "Berlin"}])["id"]
        worker.start()
        wait_for(lambda: len(_field_indexes(db)) == 1, timeout=30, what="the field index")
        api.delete(f"/segment/{segment}")
        wait_for(lambda: _field_indexes(db) == [], timeout=30, what="the index dropped")
    finally:
        stop.set()
        worker.join(10)
    assert not worker.is_alive()


def test_a_batch_reads_a_conditioned_segment_from_the_fields_index(api, db, people):
    """A batch queues a segment's recipients in address order; with a
    condition the ids are chosen first, so the field's index serves them
    (in address order alone SQLite walked the whole datasource), and the
    same recipients come out."""
    segment = api.put("/segment/0", name="s", datasources=[people],
                      conditions=[{"field": "city", "op": "eq", "value": "BERLIN"}])["id"]
    # internal: the worker's step that makes field indexes, run here at once
    campaignapi._index_conditioned_fields(db, limit=100)
    with database(db) as conn:
        row = conn.execute("SELECT * FROM segment WHERE id = ?", (int(segment),)).fetchone()
        # internal: the WHERE clause a batch's queueing reads (enqueue(recipients=...))
        where, params = campaignapi._segment_members(conn, row)
        sql = f"SELECT r.email FROM recipient r WHERE {where} ORDER BY r.email"
        plan = _plan(conn, sql, params)
        assert "recipient_field_" in plan, plan
        assert [r[0] for r in conn.execute(sql, params)] == ["ann@example.com",
                                                            "cy@example.com"]
