"""Explicit ids (API.md section 4): a create chooses an id up to 2^53 - 1, and
no explicit id, however large, stops later creates at id 0 from getting a
free id of the usual size, for any account, on either engine."""

import json
import random
import threading

import pytest
import webtest

import campaignapi
from conftest import Api, serving
from helpers import HTML, TEXT, database, http, in_threads, make_campaign, scalar, send

LARGEST = 2**53 - 1    # the contract's limit (campaignapi.MAX_EXPLICIT_ID)
TOO_LARGE = [str(LARGEST + 1), "9223372036854775807", "9223372036854775808", "1" * 30]
# What "sane" means here: every id a create at 0 got in these tests is small.
SMALL = 10_000


def _datasource(api):
    return int(api.put("/datasource/0", name="list")["id"])


def _campaign(api):
    """A sendable campaign (one recipient) and its records' ids."""
    ds = int(api.put("/datasource/0", name="list",
                     fields=[{"name": "first", "type": "text"}])["id"])
    api.put(f"/datasource/{ds}/recipient/0", email="someone@example.com")
    return make_campaign(api, [ds])


# Each kind: (its table, a function (api, n) -> (the create's path without
# the id, its parameters)) for the n-th create of the test; the records it
# needs are made anew each time, so that every create is allowed.
KINDS = {
    "datasource": ("datasource", lambda api, n: ("/datasource", {"name": f"list {n}"})),
    "message": ("message", lambda api, n: ("/message", {
        "name": f"m{n}", "subject": "Hi", "html": HTML, "text": TEXT})),
    "segment": ("segment", lambda api, n: ("/segment", {
        "name": f"s{n}", "datasources": [_datasource(api)]})),
    "accountprofile": ("accountprofile", lambda api, n: ("/accountprofile", {
        "name": f"p{n}", "fromname": "Shop", "fromaddress": "news@shop.example"})),
    "template": ("template", lambda api, n: ("/template", {
        "name": f"t{n}", "html": "<div>{{content}}</div>", "text": "{{content}}"})),
    "campaign": ("campaign", lambda api, n: ("/campaign", {
        "name": f"c{n}", "accountprofile": int(api.put("/accountprofile/0", name="p",
                                                        fromname="Shop")["id"])})),
    "webhook": ("webhook", lambda api, n: ("/webhook", {"url": f"http://127.0.0.1:9/hook{n}"})),
    "recipient": ("recipient", lambda api, n: (f"/datasource/{_datasource(api)}/recipient", {
        "email": f"person{n}@example.com"})),
    "import": ("import", lambda api, n: (f"/datasource/{_datasource(api)}/import", {
        "name": f"i{n}", "originalfile": "people.csv", "__uploadtype__": "csv",
        "__uploaddata__": f"email\nperson{n}@example.com\n"})),
    "organize": ("organize", lambda api, n: _organize(api)),
    "campaign message": ("campaign_message", lambda api, n: _link(api)),
    "batch": ("batch", lambda api, n: (f"/campaign/{_campaign(api)['campaign']}/send", {
        "timestamp": "2000-01-01 00:00:00"})),
}
OWNED = ["datasource", "message", "segment", "accountprofile", "template", "campaign",
         "webhook"]


def _organize(api):
    ds = _datasource(api)
    return f"/datasource/{ds}/organize", {"item": ds, "folder": "top", "sortorder": 1}


def _link(api):
    ids = _campaign(api)
    message = api.put("/message/0", name="more", subject="Hi", html=HTML, text=TEXT)["id"]
    return f"/campaign/{ids['campaign']}/message", {"segment": int(ids["segment"]),
                                                    "message": int(message)}


@pytest.fixture
def apis(db):
    """An Api of the owner and one of another account, on an app that takes
    loopback webhook URLs."""
    client = webtest.TestApp(campaignapi.create_app(db, webhook_allow_private=True))
    return [Api(client, {"Authorization": "Bearer " + campaignapi.create_key(db, email)})
            for email in ("owner@example.com", "stranger@example.org")]


def create(api, kind, n, record_id, status=200):
    path, params = KINDS[kind][1](api, n)
    return api.put(f"{path}/{record_id}", status=status, **params)


@pytest.mark.parametrize("kind", list(KINDS))
def test_creates_at_0_after_the_largest_explicit_id(apis, db, kind):
    owner, stranger = apis
    table = KINDS[kind][0]
    first = int(create(owner, kind, 1, 0)["id"])
    assert create(owner, kind, 2, LARGEST)["id"] == str(LARGEST)
    # Later creates at 0, of either account, get free ids of the usual size.
    made = [int(create(api, kind, n, 0)["id"]) for n, api in
            enumerate([owner, stranger, owner, stranger], start=3)]
    assert len(set(made)) == len(made) and first not in made and LARGEST not in made
    assert all(0 < made_id < SMALL for made_id in made), made
    assert made == sorted(made)
    # Every record is stored at the id its create answered.
    ids = {row[0] for row in database_rows(db, f"SELECT id FROM {table}")}
    assert {first, LARGEST, *made} <= ids
    # A taken id is still a conflict, the largest included.
    assert create(stranger, kind, 7, LARGEST, status=409)["error"] == "conflict"
    assert create(owner, kind, 8, made[0], status=409)["error"] == "conflict"


def database_rows(db, sql):
    with database(db) as conn:
        return conn.execute(sql).fetchall()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("too_large", TOO_LARGE)
def test_an_explicit_id_past_2_53_is_refused_and_changes_nothing(apis, db, kind, too_large):
    owner, _ = apis
    table = KINDS[kind][0]
    path, params = KINDS[kind][1](owner, 1)
    before = scalar(db, f"SELECT count(*) FROM {table}")
    data = owner.put(f"{path}/{too_large}", status=400, **params)
    assert data["error"] == "invalid_identifier"
    assert data["field"] == ("id" if path.count("/") == 1 else "child_id")
    assert scalar(db, f"SELECT count(*) FROM {table}") == before
    assert int(create(owner, kind, 2, 0)["id"]) < SMALL


@pytest.mark.parametrize("kind", OWNED)
def test_explicit_ids_close_ahead_are_stepped_over(apis, kind):
    """An id chosen a little ahead of the last one: creates at 0 go past it
    (never meet it as taken), and stay below one chosen far ahead."""
    owner, stranger = apis
    last = int(create(owner, kind, 1, 0)["id"])
    create(owner, kind, 2, last + 1)
    create(stranger, kind, 3, last + 3)
    create(owner, kind, 4, 2**40)
    made = [int(create(api, kind, n, 0)["id"]) for n, api in
            enumerate([owner, stranger, owner], start=5)]
    assert len(set(made)) == 3 and not {last + 1, last + 3} & set(made)
    assert all(last < made_id < SMALL for made_id in made), made


def test_reading_an_id_past_2_53_is_an_unknown_id(api):
    """Only creates are limited: any int64 id reads (404 when there is none)."""
    assert api.get(f"/message/{LARGEST + 1}", status=404)["error"] == "not_found"
    assert api.post(f"/message/{2**63 - 1}", status=404, name="x")["error"] == "not_found"


def test_the_document_says_the_limit(client):
    paths = client.get("/v1/openapi.json").json["paths"]
    create_id = next(p for p in paths["/v1/message/{id}"]["put"]["parameters"]
                     if p["name"] == "id")
    read_id = next(p for p in paths["/v1/message/{id}"]["get"]["parameters"]
                   if p["name"] == "id")
    assert str(LARGEST) in create_id["description"]
    assert create_id["schema"]["pattern"] == "^([0-9]{1,15})$"
    assert read_id["schema"]["pattern"].startswith("^([0-9]{1,18}|")


def test_imports_and_sign_ups_after_explicit_recipient_ids(apis, db):
    """Recipients come from creates, imports (the bulk paths of each engine)
    and public sign-ups: with recipients at 2^53 - 1 and just ahead, all of
    them still store every row, at ids of the usual size."""
    owner, _ = apis
    ds = _datasource(owner)
    profile = owner.put("/accountprofile/0", name="List", fromname="The List",
                        fromaddress="list@shop.example")["id"]
    owner.post(f"/datasource/{ds}", signup=1, doubleoptin=0, fromprofile=int(profile))
    first = int(owner.put(f"/datasource/{ds}/recipient/0", email="a@example.com")["id"])
    owner.put(f"/datasource/{ds}/recipient/{LARGEST}", email="b@example.com")
    owner.put(f"/datasource/{ds}/recipient/{first + 2}", email="c@example.com")
    rows = "".join(f"p{n}@example.com\n" for n in range(300))
    record = owner.put(f"/datasource/{ds}/import/0", name="i", originalfile="people.csv",
                       __uploadtype__="csv",
                       __uploaddata__="email\n" + rows)
    imported = owner.get(f"/datasource/{ds}/import/{record['id']}")["import"]
    assert imported["status"] == "finished" and imported["inserted"] == "300"
    response = send(owner.client, "POST", f"/v1/subscribe/{ds}", {}, {"email": "s@example.com"})
    assert response.status_int == 200, response.text
    ids = {email: recipient_id for recipient_id, email in database_rows(
        db, f"SELECT id, email FROM recipient WHERE datasource = {ds}")}
    assert len(ids) == 304 and ids["b@example.com"] == LARGEST
    assert all(recipient_id < SMALL for email, recipient_id in ids.items()
               if email != "b@example.com")
    assert int(owner.put(f"/datasource/{ds}/recipient/0", email="d@example.com")["id"]) < SMALL


def test_creates_step_over_a_far_explicit_id_when_they_reach_it(engine_db, monkeypatch):
    """With a reach of 8 instead of 2^20: an id chosen 20 ahead does not move
    the ids; the creates at 0 go on below it and past it without a 409."""
    # internal: a reach of 8, not 2**20, so that a test can reach it
    monkeypatch.setattr(campaignapi, "_ID_REACH", 8)
    campaignapi.init_db(engine_db)      # PostgreSQL's trigger takes the reach here
    client = webtest.TestApp(campaignapi.create_app(engine_db))
    api = Api(client, {"Authorization": "Bearer " + campaignapi.create_key(
        engine_db, "owner@example.com")})
    params = {"name": "m", "subject": "Hi", "html": HTML, "text": TEXT}
    assert api.put("/message/0", **params) == {"id": "1"}
    assert api.put("/message/21", **params) == {"id": "21"}
    made = [int(api.put("/message/0", **params)["id"]) for _ in range(25)]
    assert 21 not in made and len(set(made)) == 25
    assert made[:10] == list(range(2, 12))     # not moved by the id far ahead
    assert made[-1] < 21 + 8 + 25              # past it, without a jump beyond the reach


def test_a_database_an_explicit_id_broke_before_version_4_creates_again(engine_db):
    """Before version 4 PostgreSQL's sequence followed an explicit id to
    2^63 - 1 and every later create failed; the upgrade brings it back."""
    campaignapi.init_db(engine_db)
    key = campaignapi.create_key(engine_db, "owner@example.com")
    with database(engine_db) as conn:
        profile = conn.execute("INSERT INTO accountprofile (owner, name, created) "
                               "VALUES (1, 'p', '2024-01-01 00:00:00')").lastrowid
        conn.execute("INSERT INTO accountprofile (id, owner, name, created) "
                     "VALUES (?, 1, 'q', '2024-01-01 00:00:00')", (2**63 - 1,))
        if conn.engine == "postgresql":
            conn.execute("SELECT setval('accountprofile_id_seq', ?)", (2**63 - 1,))
        else:
            conn.execute("DROP TABLE id_sequence")
        conn.set_schema_version(3)
    api = Api(webtest.TestApp(campaignapi.create_app(engine_db)),
              {"Authorization": f"Bearer {key}"})
    made = int(api.put("/accountprofile/0", name="r", fromname="Shop")["id"])
    assert profile < made < SMALL


def test_concurrent_creates_on_two_servers_never_meet_a_taken_id(db):
    """Two apps on one database (two hosts), 8 clients at once: creates at 0
    and at ids chosen just ahead of the last (a 409 where another took it)
    and far ahead.  No 5xx, every create at 0 gets its own id, all stored."""
    secret = campaignapi.create_key(db, "owner@example.com")
    headers = {"Authorization": f"Bearer {secret}"}
    params = {"name": "m", "subject": "Hi", "html": HTML, "text": TEXT}
    answers, lock = [], threading.Lock()
    with serving(campaignapi.create_app(db), threads=4) as one, \
            serving(campaignapi.create_app(db), threads=4) as two:
        def client(seed):
            chance = random.Random(seed)
            for n in range(15):
                base = (one, two)[n % 2]
                record_id = chance.choice([0, 0, 0, "near", "far"])
                if record_id == "near":
                    record_id = len(answers) + chance.randint(1, 12)
                elif record_id == "far":
                    record_id = chance.randint(2**40, 2**53 - 1)
                status, _, body = http(f"{base}/v1/message/{record_id}", "PUT", params, headers,
                                       timeout=60)
                with lock:
                    answers.append((record_id, status, json.loads(body)["data"]))

        in_threads(client, range(8), timeout=120)
    assert {status for _, status, _ in answers} <= {200, 409}, answers
    made = [int(data["id"]) for record_id, status, data in answers if status == 200]
    assert len(made) == len(set(made))
    assert all(record_id == 0 or status == 409 or int(data["id"]) == record_id
               for record_id, status, data in answers)
    assert all(0 < int(data["id"]) < SMALL for record_id, status, data in answers
               if record_id == 0), answers
    stored = {row[0] for row in database_rows(db, "SELECT id FROM message")}
    assert set(made) == stored


def test_ids_taken_by_many_sessions_at_once_are_never_handed_out_twice(engine_db):
    """Inserts at default ids from six sessions at once, each its own
    transaction, as public writes and imports do.  On PostgreSQL the id
    trigger once read the sequence, then found rows other sessions committed
    meanwhile (each statement of a function sees a new snapshot) and moved
    the sequence back to them with setval(), under ids a third session had
    already taken: a duplicate key for that session."""
    campaignapi.init_db(engine_db)
    failures, lock = [], threading.Lock()

    def session(number):
        conn = campaignapi.connect(engine_db)
        try:
            for n in range(150):
                try:
                    with campaignapi.transaction(conn):
                        conn.execute("INSERT INTO account (email) VALUES (?)",
                                     (f"s{number}-{n}@example.com",))
                except Exception as error:   # noqa: BLE001 (counted: the test's finding)
                    with lock:
                        failures.append(repr(error))
        finally:
            conn.close()

    in_threads(session, range(6), timeout=120)
    assert failures == []
    assert scalar(engine_db, "SELECT count(DISTINCT id) FROM account") == 6 * 150
