"""Campaign messages (links), structure and verify."""


import os
import shutil

import pytest

import campaignapi
from conftest import Api
from helpers import add_recipients, database, later

GOOD_MESSAGE = {"name": "Welcome", "subject": "Hello {{firstname}}",
                "html": '<p>Hi {{firstname}}</p><a href="{{unsubscribe_url}}">stop</a>',
                "text": "Hi {{FirstName}}. Stop: {{ unsubscribe_url }}"}


def build(api, db):
    """A campaign that passes verify, built over HTTP the way a client would;
    the recipients go straight into the database (imports are another part)."""
    ds = int(api.put("/datasource/0", name="people", fields=[{"name": "firstname"}])["id"])
    add_recipients(db, ds, [("ann@example.com", {"firstname": "Ann"}),
                            ("bob@example.com", {"firstname": "Bob"})])
    profile = api.put("/accountprofile/0", name="Shop", fromname="Shop",
                      fromaddress="news@example.com")["id"]
    message = api.put("/message/0", **GOOD_MESSAGE)["id"]
    segment = api.put("/segment/0", name="all", datasources=[ds])["id"]
    campaign = api.put("/campaign/0", name="Spring", accountprofile=int(profile))["id"]
    link = api.put(f"/campaign/{campaign}/message/0", segment=segment, message=message)["id"]
    return {"ds": ds, "profile": profile, "message": message, "segment": segment,
            "campaign": campaign, "link": link}


def verify(api, campaign):
    record = api.get(f"/campaign/{campaign}/verify/0")["verify"]
    return record, {check["check"]: check for check in record["checks"]}


def failing(api, campaign):
    record, checks = verify(api, campaign)
    failed = {name for name, check in checks.items() if check["passed"] == "0"}
    assert record["passed"] == ("0" if failed else "1")
    return failed, checks


# Campaign messages -------------------------------------------------------------

def test_link_create_get_change_delete(api, db):
    made = build(api, db)
    c, link = made["campaign"], made["link"]
    record = api.get(f"/campaign/{c}/message/{link}")["message"]
    assert record == {"id": link, "campaign": c, "segment": made["segment"],
                      "message": made["message"], "priority": "0",
                      "subject": GOOD_MESSAGE["subject"], "name": "Welcome", "variants": []}
    other = api.put("/message/0", name="Second", subject="Two")["id"]
    second = api.put(f"/campaign/{c}/message/0", segment=made["segment"], message=other,
                     priority=5)["id"]
    listing = api.get(f"/campaign/{c}/message/all")
    assert listing["total"] == "2" and [r["id"] for r in listing["message"]] == [link, second]

    assert api.post(f"/campaign/{c}/message/{second}", segmentmessageid=int(second),
                    priority="0") is True
    assert api.get(f"/campaign/{c}/message/{second}")["message"]["priority"] == "0"
    error = api.post(f"/campaign/{c}/message/{second}", status=409, segmentmessageid=link)
    assert error["field"] == "segmentmessageid"
    api.post(f"/campaign/{c}/message/{second}", status=400, priority=1)  # id is required

    api.delete(f"/campaign/{c}/message/{second}", status=409, segmentmessagehack=int(link))
    assert api.delete(f"/campaign/{c}/message/{second}", segmentmessagehack=second) is True
    api.get(f"/campaign/{c}/message/{second}", status=404)
    assert api.get(f"/campaign/{c}/message/all")["total"] == "1"


def test_duplicate_links_are_409(api, db):
    made = build(api, db)
    c = made["campaign"]
    error = api.put(f"/campaign/{c}/message/0", status=409, segment=made["segment"],
                    message=made["message"])
    assert error["error"] == "conflict" and f"campaign message {made['link']}" in error["message"]
    other = api.put("/message/0", name="Second")["id"]
    second = api.put(f"/campaign/{c}/message/0", segment=made["segment"], message=other)["id"]
    api.post(f"/campaign/{c}/message/{second}", status=409, segmentmessageid=second,
             message=made["message"])
    assert api.put(f"/campaign/{c}/message/{second}", status=409, segment=made["segment"],
                   message=made["message"])["error"] == "conflict"


def test_links_check_ownership_and_state(api, stranger_api, db):
    made = build(api, db)
    c = made["campaign"]
    theirs = {"message": stranger_api.put("/message/0", name="x")["id"],
              "segment": stranger_api.put("/segment/0", name="x")["id"]}
    api.put(f"/campaign/{c}/message/0", status=404, segment=made["segment"],
            message=theirs["message"])
    api.put(f"/campaign/{c}/message/0", status=404, segment=theirs["segment"],
            message=made["message"])
    stranger_api.get(f"/campaign/{c}/message/{made['link']}", status=404)
    stranger_api.get(f"/campaign/{c}/message/all", status=404)
    stranger_api.delete(f"/campaign/{c}/message/{made['link']}", status=404,
                        segmentmessagehack=made["link"])
    their_campaign = stranger_api.put("/campaign/0", name="x", accountprofile=1)["id"]
    api.get(f"/campaign/{their_campaign}/message/{made['link']}", status=404)

    gone = api.put("/message/0", name="gone")["id"]
    api.delete(f"/message/{gone}")
    api.put(f"/campaign/{c}/message/0", status=409, segment=made["segment"], message=gone)
    api.delete(f"/campaign/{c}")
    api.put(f"/campaign/{c}/message/0", status=409, segment=made["segment"],
            message=api.put("/message/0", name="new")["id"])
    api.get(f"/campaign/{c}/message/{made['link']}")  # still readable


def test_link_levels_follow_the_spec(client, make_key, api, db):
    made = build(api, db)
    c, link = made["campaign"], made["link"]
    write_only = Api(client, make_key(levels=["write"]))
    delete_only = Api(client, make_key(levels=["delete"]))
    write_only.put(f"/campaign/{c}/message/0", status=403, segment=1, message=1)
    delete_only.delete(f"/campaign/{c}/message/{link}", status=403, segmentmessagehack=link)
    write_only.post(f"/campaign/{c}/message/{link}", segmentmessageid=link, priority=2)
    write_only.delete(f"/campaign/{c}/message/{link}", segmentmessagehack=link)


def test_link_identifiers(api, db):
    made = build(api, db)
    c = made["campaign"]
    assert api.get(f"/campaign/{c}/message/first", status=400)["error"] == "invalid_identifier"
    api.put(f"/campaign/{c}/message/all", status=400, segment=1, message=1)
    api.get(f"/campaign/all/message/{made['link']}", status=400)
    assert api.put(f"/campaign/{c}/message/77", segment=made["segment"],
                   message=api.put("/message/0", name="m")["id"])["id"] == "77"


# Structure ---------------------------------------------------------------------

def test_structure_orders_segments_and_counts_overlaps(api, db):
    made = build(api, db)        # segment 'all': ann, bob
    c = made["campaign"]
    other = int(api.put("/datasource/0", name="vip", fields=[{"name": "firstname"}])["id"])
    add_recipients(db, other, [("ANN@example.com", {}), ("cy@example.com", {}),
                               ("dee@example.com", {})])
    vip = api.put("/segment/0", name="vip", datasources=[other])["id"]
    none = api.put("/segment/0", name="nobody", datasources=[other],
                   conditions=[{"field": "email", "op": "eq", "value": "x@example.com"}])["id"]
    messages = [api.put("/message/0", name=f"m{i}")["id"] for i in range(3)]
    api.put(f"/campaign/{c}/message/0", segment=vip, message=messages[0], priority=0)
    api.put(f"/campaign/{c}/message/0", segment=none, message=messages[1], priority=9)
    api.put(f"/campaign/{c}/message/0", segment=vip, message=messages[2], priority=1)
    api.post(f"/campaign/{c}/message/{made['link']}", segmentmessageid=made["link"],
             priority=3)

    assert api.get(f"/campaign/{c}/structure/{c}") == api.get(f"/campaign/{c}/structure/0")
    structure = api.get(f"/campaign/{c}/structure/0")["structure"]
    assert structure["id"] == c and structure["campaign"] == c
    by_order = [(s["segment"], s["name"], s["priority"], s["messages"], s["size"])
                for s in structure["segments"]]
    assert by_order == [(vip, "vip", "0", [messages[0], messages[2]], "3"),
                        (made["segment"], "all", "3", [made["message"]], "2"),
                        (none, "nobody", "9", [messages[1]], "0")]
    overlaps = {s["segment"]: {o["segment"]: o["shared"] for o in s["overlap"]}
                for s in structure["segments"]}
    assert overlaps == {vip: {made["segment"]: "1", none: "0"},
                        made["segment"]: {vip: "1", none: "0"},
                        none: {vip: "0", made["segment"]: "0"}}


def test_overlaps_of_many_segments_match_sets_of_addresses(api, db):
    """65 segments (two mask columns) over two datasources where the same
    address comes in other cases: every size and every pair's overlap equals
    the one computed from Python sets of the lower-cased addresses."""
    one = int(api.put("/datasource/0", name="one")["id"])
    two = int(api.put("/datasource/0", name="two")["id"])
    lists = {one: [f"u{i}@example.com" for i in range(40)],
             two: [f"U{i}@Example.com" for i in range(0, 40, 3)] + [f"v{i}@example.com"
                                                                    for i in range(12)]}
    for datasource, addresses in lists.items():
        add_recipients(db, datasource, [(address, {}) for address in addresses])
    expected, segments = {}, []
    for k in range(65):
        chosen = [[one], [two], [one, two]][k % 3]
        digit = str(k % 10)
        segments.append(api.put("/segment/0", name=f"s{k}", datasources=chosen, conditions=[
            {"field": "email", "op": "contains", "value": digit}] if k % 4 else [])["id"])
        expected[segments[-1]] = {address.lower() for datasource in chosen
                                  for address in lists[datasource]
                                  if not k % 4 or digit in address}
    conn = campaignapi.connect(db)
    try:
        rows = [conn.execute("SELECT * FROM segment WHERE id = ?", (int(s),)).fetchone()
                for s in segments]
        # internal: the overlap query itself, against an oracle
        counts = campaignapi._segment_overlaps(conn, rows)
        # internal: the overlap query itself, against an oracle
        assert campaignapi._segment_overlaps(conn, rows[:1]) == {
            (rows[0]["id"], rows[0]["id"]): len(expected[segments[0]])}
        # internal: the overlap query itself, against an oracle
        assert campaignapi._segment_overlaps(conn, []) == {}
    finally:
        conn.close()
    for a in segments:
        for b in segments:
            assert counts.get((int(a), int(b)), 0) == len(expected[a] & expected[b]), (a, b)


@pytest.mark.parametrize("indexed", [False, True], ids=["scanned", "indexed"])
def test_overlaps_of_a_few_segments_of_one_datasource_match_sets(api, db, indexed):
    """Up to four segments of one datasource are counted a pair at a time
    (each pair's WHEREs joined, which field indexes serve): every size and
    overlap equals the one from Python sets, with and without the index of
    the compared field; deleted and unsubscribed recipients are left out."""
    ds = int(api.put("/datasource/0", name="one", fields=[{"name": "n", "type": "integer"}])["id"])
    people = {f"u{i}@example.com": i for i in range(30)}
    add_recipients(db, ds, [(address, {"n": n}) for address, n in people.items()])
    add_recipients(db, ds, [("gone@example.com", {"n": 3})], status="unsubscribed")
    tests = {"all": lambda a, n: True, "n<10": lambda a, n: n < 10,
             "n>4": lambda a, n: n > 4, "has 2": lambda a, n: "2" in a}
    conditions = {"all": [], "n<10": [{"field": "n", "op": "lt", "value": 10}],
                  "n>4": [{"field": "n", "op": "gt", "value": 4}],
                  "has 2": [{"field": "email", "op": "contains", "value": "2"}]}
    segments = {name: api.put("/segment/0", name=name, datasources=[ds],
                              conditions=conditions[name])["id"] for name in tests}
    if indexed:
        # internal: the worker's step that makes the index of the compared field
        assert campaignapi._index_conditioned_fields(db, limit=100) == 1
    with database(db) as conn:
        rows = [conn.execute("SELECT * FROM segment WHERE id = ?", (int(s),)).fetchone()
                for s in segments.values()]
        # internal: the overlap query itself, against an oracle
        counts = campaignapi._segment_overlaps(conn, rows)
    chosen = {segments[name]: {a for a, n in people.items() if test(a, n)}
              for name, test in tests.items()}
    assert {(str(a), str(b)): n for (a, b), n in counts.items()} == {
        (a, b): len(chosen[a] & chosen[b]) for a in chosen for b in chosen}


def test_structure_of_an_empty_campaign_and_bad_ids(api, stranger_api):
    c = api.put("/campaign/0", name="empty", accountprofile=1)["id"]
    assert api.get(f"/campaign/{c}/structure/0")["structure"]["segments"] == []
    assert api.get(f"/campaign/{c}/structure/{int(c) + 1}", status=404)["error"] == "not_found"
    api.get(f"/campaign/{c}/structure/all", status=400)
    stranger_api.get(f"/campaign/{c}/structure/0", status=404)
    api.get(f"/campaign/{c}/verify/5", status=404)
    stranger_api.get(f"/campaign/{c}/verify/0", status=404)


# Verify ------------------------------------------------------------------------

def test_a_campaign_from_nothing_until_verify_passes(api, db):
    """verify says exactly what is missing, step by step."""
    campaign = api.put("/campaign/0", name="From nothing", accountprofile=9)["id"]
    failed, checks = failing(api, campaign)
    assert failed == {"sender_profile", "sender_address", "campaign_messages"}
    assert "PUT /v1/accountprofile/9" in checks["sender_profile"]["message"]

    api.put("/accountprofile/9", name="Shop", fromname="Shop")
    failed, checks = failing(api, campaign)
    assert failed == {"sender_address", "campaign_messages"}
    assert "POST /v1/accountprofile/9" in checks["sender_address"]["message"]
    api.post("/accountprofile/9", fromaddress="news@example.com")

    ds = int(api.put("/datasource/0", name="people")["id"])
    segment = api.put("/segment/0", datasources=[ds])["id"]
    message = api.put("/message/0", name="Hi")["id"]
    api.put(f"/campaign/{campaign}/message/0", segment=segment, message=message)
    failed, checks = failing(api, campaign)
    assert failed == {"message_subject", "message_body", "unsubscribe_link",
                      "segment_recipients"}
    assert f"POST /v1/message/{message}" in checks["message_subject"]["message"]

    api.post(f"/message/{message}", subject="Hi {{firstname}}",
             text="Hello. Leave: {{unsubscribe_url}}")
    add_recipients(db, ds, [("ann@example.com", {})])
    failed, checks = failing(api, campaign)
    assert failed == {"merge_tags"}
    assert "{{firstname}}" in checks["merge_tags"]["message"]

    api.post(f"/datasource/{ds}", fields=[{"name": "FirstName"}])
    record, checks = verify(api, campaign)
    assert record["passed"] == "1", checks
    assert record["verified"] <= later() and record["id"] == campaign
    assert all(check["message"] for check in checks.values())


def _set(db, table, row_id, **values):
    """Put a stored value the API would refuse (old data, another writer)."""
    conn = campaignapi.connect(db)
    with campaignapi.transaction(conn):
        for column, value in values.items():
            conn.execute(f"UPDATE {table} SET {column} = ? WHERE id = ?", (value, row_id))
    conn.close()


def _template_without_content(api, db, made):
    template = api.put("/template/0", html="<div>{{content}}</div>")["id"]
    api.post(f"/campaign/{made['campaign']}", defaulttemplate=template)
    _set(db, "template", template, html="<div>no place for the message</div>")


#: One way to break each check of a campaign that passes, and words the
#: failing check's message must hold to be of use.
BREAKERS = {
    "campaign_enabled": (lambda api, db, m: api.post(f"/campaign/{m['campaign']}", enabled=0),
                         "enabled '1'"),
    "campaign_not_deleted": (lambda api, db, m: _set(db, "campaign", m["campaign"], deleted=1),
                             "create a new campaign"),
    "sender_profile": (lambda api, db, m: api.delete(f"/accountprofile/{m['profile']}"),
                       "is deleted"),
    "sender_address": (lambda api, db, m: api.post(f"/accountprofile/{m['profile']}",
                                                   fromaddress=""), "set fromaddress"),
    "campaign_messages": (lambda api, db, m: api.delete(
        f"/campaign/{m['campaign']}/message/{m['link']}", segmentmessagehack=m["link"]),
        "PUT /v1/campaign/"),
    "links_in_use": (lambda api, db, m: api.delete(f"/segment/{m['segment']}"),
                     "DELETE /v1/campaign/"),
    "message_subject": (lambda api, db, m: api.post(f"/message/{m['message']}", subject=" "),
                        "no subject"),
    "message_from": (lambda api, db, m: _set(db, "message", m["message"],
                                             fromaddress="not-an-address"), "fromaddress"),
    "message_body": (lambda api, db, m: _set(db, "message", m["message"], html="", text=" "),
                     "no body"),
    "template_found": (lambda api, db, m: _set(db, "campaign", m["campaign"],
                                               defaulttemplate="999"), "PUT /v1/template/999"),
    "template_content": (lambda api, db, m: _template_without_content(api, db, m),
                         "{{content}} exactly once"),
    "unsubscribe_link": (lambda api, db, m: api.post(f"/message/{m['message']}",
                                                     text="No way out"), "text body"),
    "merge_tags": (lambda api, db, m: api.post(f"/message/{m['message']}",
                                               subject="Hi {{nickname}}"), "{{nickname}}"),
    "variants": (lambda api, db, m: api.post(  # an A/B test of a campaign without tracking
        f"/campaign/{m['campaign']}/message/{m['link']}", segmentmessageid=m["link"],
        variants=[int(api.put("/message/0", **GOOD_MESSAGE)["id"])]), "tracking '1'"),
    "segment_recipients": (lambda api, db, m: api.post(
        f"/segment/{m['segment']}", conditions=[{"field": "firstname", "op": "eq",
                                                 "value": "Zoe"}]), "no active recipients"),
    "segment_definition": (lambda api, db, m: _set(
        db, "segment", m["segment"],
        conditions='[{"field": "height", "op": "empty", "value": null}]'), "'height'"),
    "archive_email": (lambda api, db, m: _set(db, "campaign", m["campaign"],
                                              archiveemail="archive at example"),
                      "archiveemail"),
    "reply_to": (lambda api, db, m: _set(db, "accountprofile", m["profile"], replyto="nope"),
                 "replyto 'nope'"),
    "header_line_breaks": (lambda api, db, m: _set(db, "message", m["message"],
                                                   fromname="Shop\r\nBcc: x@example.com"),
                           "fromname of message"),
    "size": (lambda api, db, m: api.post(f"/message/{m['message']}", html="<p>Long.</p>" * 10000
                                         + '<a href="{{unsubscribe_url}}">Unsubscribe</a>'),
             "102 KB"),
    # GTUBE: the string every SpamAssassin scores 1000 (its own test of the filter).
    "spam": (lambda api, db, m: api.post(
        f"/message/{m['message']}", text="XJS*C4JDBQADN1.NSBN3*2IDNEN*GTUBE-STANDARD-ANTI-UBE-"
        "TEST-EMAIL*C.34X\nUnsubscribe: {{unsubscribe_url}}"), "GTUBE"),
}


#: Checks that fail along with another because they depend on the same thing.
CASCADES = {"sender_profile": {"sender_address", "message_from"},
            "sender_address": {"message_from"},
            "message_body": {"unsubscribe_link"}}


def test_every_check_is_listed_once(api, db):
    made = build(api, db)
    record, checks = verify(api, made["campaign"])
    assert record["passed"] == "1", checks
    # non_ascii_addresses only warns (tests/test_smtputf8.py): nothing breaks it;
    # links runs only when asked (tests/test_deliverability_checks.py).
    assert [check["check"] for check in record["checks"] if check["check"] not in
            ("non_ascii_addresses", "links")] == list(BREAKERS)
    # internal: verify's own list of checks
    assert [name for name, _ in campaignapi._VERIFY_CHECKS] == [
        check["check"] for check in record["checks"]]
    assert all(check["passed"] == "1" for check in record["checks"])


@pytest.mark.parametrize("name", list(BREAKERS))
def test_each_failing_check_says_what_to_fix(api, db, name):
    if name == "spam" and not (shutil.which("spamassassin") or os.environ.get("CI")):
        pytest.skip("spamassassin is missing (apt-get install spamassassin)")
    made = build(api, db)
    breaker, words = BREAKERS[name]
    breaker(api, db, made)
    failed, checks = failing(api, made["campaign"])
    assert failed == {name} | CASCADES.get(name, set()), checks
    assert words in checks[name]["message"], checks[name]["message"]


def test_verify_campaign_is_public(api, db):
    made = build(api, db)
    conn = campaignapi.connect(db)
    try:
        record = campaignapi.verify_campaign(conn, 1, int(made["campaign"]))
        assert record["passed"] == "1"
        with pytest.raises(campaignapi.NotFound):
            campaignapi.verify_campaign(conn, 2, int(made["campaign"]))
    finally:
        conn.close()
