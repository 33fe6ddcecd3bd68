"""References: every parameter that names a record -- a body parameter, an
item of a nested list, a key of a nested object, the path's record repeated in
the body -- answers another account's record exactly as an unknown one and
changes nothing; and what a campaign builds (preview, test send, delivery)
never shows another account's sender profile, however the campaign points at it."""

import re

import pytest

import campaignapi
from conftest import Api
from helpers import KEYED_ROUTES, build_world, database, route_id, send, snapshot

#: An id that no record of any kind has; the walk creates at UNKNOWN + 1 and + 2.
UNKNOWN = 9_000_000

#: Parameters that name a record but cannot say so as ``name:type@kind`` in the
#: route table: names inside a nested list or object, and a recipient of the
#: link's segment.  (method, path, parameter) -> what it names.
NESTED = {
    ("PUT", "/segment/{id}", "conditions"): "conditions[].field: a field of its datasources",
    ("POST", "/segment/{id}", "conditions"): "conditions[].field: a field of its datasources",
    ("PUT", "/datasource/{parent_id}/recipient/{child_id}", "fields"): "a field by name",
    ("POST", "/datasource/{parent_id}/recipient/{child_id}", "fields"): "a field by name",
    ("GET", "/campaign/{parent_id}/preview/{child_id}", "recipient"): "a recipient (id or address)",
    ("POST", "/campaign/{parent_id}/winner/{child_id}", "link"): "a link tested by the batch",
    ("PUT", "/automation/{id}", "steps"): "steps[].send: a message",
    ("POST", "/automation/{id}", "steps"): "steps[].send: a message",
    ("PUT", "/automation/{id}", "trigger"): "trigger.field: a field of its datasource",
    ("POST", "/automation/{id}", "trigger"): "trigger.field: a field of its datasource",
    ("PUT", "/automation/{parent_id}/run/{child_id}", "recipient"): "a recipient of its datasource",
    ("GET", "/automation/{parent_id}/run/{child_id:int|all}", "recipient"): "a listing's filter",
}

#: Parameters of a type that could hold an id (or named like a kind) that name no record.
NOT_REFERENCES = {"limit", "offset", "priority", "sortorder", "timestamp",
                  "events",    # webhook event kinds
                  "test",      # addresses of a test send
                  "fields",    # a datasource's new fields [{name, type}] (recipient fields: NESTED)
                  "data",      # a transactional email's merge values
                  "testsize", "testwait"}     # a campaign's A/B test settings

#: Parameter types that can carry an id.
ID_TYPES = {"int", "ref", "list", "object", "scalar"}


def declared(route):
    """The route's parameters declared as naming a record (``name:type@kind``)."""
    return [name for name, param in route.params.items() if param.refers]


def repeats(route):
    """The body parameters that must repeat the record (or parent) of the path,
    as the route's record kind declares them."""
    kind, operation = route.kind, getattr(route.handler, "__name__", "")
    if kind is None:
        return []
    names = [kind.repeat[operation].rstrip("!")] if operation in kind.repeat else []
    return names + ([kind.parent_param] if operation == "create" and kind.parent_param else [])


CASES = [(route, name) for route in KEYED_ROUTES
         for name in declared(route) + repeats(route) + sorted(
             param for method, path, param in NESTED if (method, path) == (route.method, route.path))]


def test_the_walk_knows_every_parameter_that_may_name_a_record():
    """A new parameter that could hold an id, or is named like a record kind,
    must be declared as a reference, be a repeat, be listed in NESTED, or be
    listed as naming none -- so that no reference escapes the walk below."""
    walked = {(route.method, route.path, name) for route, name in CASES}
    kinds = set(campaignapi.Resource.kinds)
    for route in KEYED_ROUTES:
        for name, param in route.params.items():
            if param.type in ID_TYPES or name in kinds or name.rstrip("s") in kinds:
                assert (route.method, route.path, name) in walked or name in NOT_REFERENCES, \
                    f"{route_id(route)}: is '{name}' a reference? Declare it or list it here."
    assert {(method, path, name) for method, path, name in NESTED} <= walked, \
        "NESTED names a route or parameter the route table no longer has"


# --- the walk --------------------------------------------------------------------------------

@pytest.fixture
def world(client, auth, other, db):
    """The caller's records (``mine``) and another account's (``theirs``),
    whose sender profile, field and recipient the caller's account lacks."""
    theirs_api, mine_api = Api(client, other), Api(client, auth)
    theirs = build_world(theirs_api, send=False)
    theirs_api.post(f"/accountprofile/{theirs['profile']}", fromname="Their Name",
                    fromaddress="news@their.example", replyto="answers@their.example")
    theirs_api.post(f"/datasource/{theirs['datasource']}", fields=[{"name": "secret"}])
    theirs["recipient"] = theirs_api.put(f"/datasource/{theirs['datasource']}/recipient/0",
                                         email="only.theirs@their.example")["id"]
    mine = build_world(mine_api, send=False)
    mine["message2"] = mine_api.put("/message/0", name="second")["id"]
    mine["batch"] = mine_api.put(f"/campaign/{mine['campaign']}/send/0",   # never made here
                                 timestamp="2000-01-01 00:00:00")["id"]
    mine["recipient"] = mine_api.get(f"/datasource/{mine['datasource']}/recipient/all")[
        "recipient"][0]["id"]
    mine["automation"] = mine_api.put(
        "/automation/0", name="a", datasource=int(mine["datasource"]), trigger={"type": "api"},
        accountprofile=int(mine["profile"]), steps=[{"send": int(mine["message"])}],
        enabled="1")["id"]
    mine["run"] = mine_api.put(f"/automation/{mine['automation']}/run/0",
                               recipient=int(mine["recipient"]))["id"]
    return {"mine": children(mine_api, mine), "theirs": children(theirs_api, theirs),
            "other": other}


def children(api, ids):
    """``ids`` of build_world() with the ids of the child records it made, and
    each record under the word its path uses."""
    ds = ids["datasource"]
    ids["link"] = api.get(f"/campaign/{ids['campaign']}/message/all")["message"][0]["id"]
    ids["import"] = api.get(f"/datasource/{ds}/import/all")["import"][0]["id"]
    ids["organize"] = api.get(f"/datasource/{ds}/organize/all")["organize"][0]["id"]
    ids["accountprofile"] = ids["profile"]
    return ids


def path_word(route):
    """The word of the record the route's path names: its kind, or its child's."""
    words = route.path.split("/")
    if len(words) < 4:
        return words[1]
    return {"message": "link", "preview": "link", "winner": "batch"}.get(words[3], words[3])


def path_of(route, mine, new_id):
    """The route's path at the caller's own records (a create of a record of
    its own at ``new_id``, of a child at 0)."""
    words = route.path.split("/")
    creates = route.method == "PUT"
    if len(words) < 4:
        return f"/v1/{words[1]}/{new_id if creates else mine[words[1]]}" if len(words) == 3 \
            else f"/v1/{words[1]}"
    return f"/v1/{words[1]}/{mine[words[1]]}/{words[3]}/{'0' if creates else mine[path_word(route)]}"


def base_body(route, mine):
    """A body the route would take, apart from the parameter under test."""
    ints = {name: int(value) for name, value in mine.items()}
    return {
        ("PUT", "/datasource/{id}"): {"name": "x"},
        ("DELETE", "/datasource/{id}"): {"id": ints["datasource"]},
        ("PUT", "/datasource/{parent_id}/recipient/{child_id}"): {"email": "new@example.com"},
        ("POST", "/datasource/{parent_id}/import/{child_id}"): {"id": ints["import"]},
        ("DELETE", "/datasource/{parent_id}/import/{child_id}"): {"id": ints["import"]},
        ("PUT", "/datasource/{parent_id}/organize/{child_id}"): {
            "item": ints["datasource"], "folder": "x", "sortorder": 1},
        ("POST", "/datasource/{parent_id}/organize/{child_id}"): {"id": ints["organize"]},
        ("PUT", "/segment/{id}"): {"name": "x", "datasources": [ints["datasource"]]},
        ("PUT", "/campaign/{id}"): {"name": "x", "accountprofile": ints["profile"]},
        ("PUT", "/campaign/{parent_id}/message/{child_id}"): {
            "segment": ints["segment"], "message": ints["message2"]},
        ("POST", "/campaign/{parent_id}/message/{child_id}"): {"segmentmessageid": ints["link"]},
        ("DELETE", "/campaign/{parent_id}/message/{child_id}"): {"segmentmessagehack": ints["link"]},
        ("POST", "/bounce"): {"email": "ann@example.com", "type": "soft"},
        ("PUT", "/transactional/{id}"): {"to": "ann@example.com", "message": ints["message"]},
        ("POST", "/campaign/{parent_id}/winner/{child_id}"): {
            "link": ints["link"], "message": ints["message"]},
        ("PUT", "/automation/{id}"): {
            "name": "x", "datasource": ints["datasource"], "trigger": {"type": "api"},
            "steps": [{"send": ints["message"]}], "accountprofile": ints["profile"]},
    }.get((route.method, route.path), {})


def values_of(route, name, theirs):
    """``[(another account's value, an unknown value)]`` for parameter ``name``."""
    if name in ("conditions", "fields", "trigger"):
        return [("secret", "nosuchfield")]
    if name == "link":
        return [(int(theirs["link"]), UNKNOWN)]
    if name == "steps":
        return [(int(theirs["message"]), UNKNOWN)]
    if name == "recipient":
        return [(int(theirs["recipient"]), UNKNOWN),
                ("only.theirs@their.example", "nobody@nowhere.example")]
    param = route.params[name]
    if param.refers:
        return [(int(theirs[param.refers]), UNKNOWN)]
    # A repeat of the path's record, or (item) of its parent.
    word = route.path.split("/")[1] if name == route.kind.parent_param else path_word(route)
    return [(int(theirs[word]), UNKNOWN)]


def given(name, value):
    """The parameter ``name`` holding ``value`` as the route takes it."""
    if name in ("datasources", "variants"):
        return [value]
    if name == "conditions":
        return [{"field": value, "op": "eq", "value": "x"}]
    if name == "fields":
        return {value: "x"}
    if name == "steps":
        return [{"send": value}]
    if name == "trigger":
        return {"type": "date", "field": value, "days": 0}
    return value


def without_time(data):
    """An answer's data as text, without the time verify stamps it with."""
    return re.sub(r"'verified': '[^']*'", "", repr(data))


def outcome(client, headers, route, response, mine):
    """What an accepted reference led to: the campaign's verify and, when it
    has a campaign message, the preview's sender headers."""
    campaign = response.json["data"]["id"] if route.method == "PUT" else mine["campaign"]
    verify = send(client, "GET", f"/v1/campaign/{campaign}/verify/0", headers).json["data"]
    answer = without_time(verify)
    if campaign == mine["campaign"]:
        preview = send(client, "GET", f"/v1/campaign/{campaign}/preview/{mine['link']}",
                       headers).json["data"]["preview"]["headers"]
        answer += repr({name: preview.get(name) for name in SENDER_HEADERS})
    return answer


@pytest.mark.parametrize("route, name", CASES, ids=lambda c: route_id(c) if hasattr(c, "path")
                         else c)
def test_another_accounts_record_is_answered_as_an_unknown_one_and_changes_nothing(
        client, auth, db, world, route, name):
    """Sent with an unknown value and with another account's, the answers
    are the same but for the value (and the id a create was asked to take);
    a refusal changes nothing, and the one reference that is accepted unknown
    (a campaign's accountprofile: verify checks it) is read as unknown too."""
    mine, theirs = world["mine"], world["theirs"]
    param = route.params[name]
    for foreign, unknown in values_of(route, name, theirs):
        answers = []
        for value, new_id in ((unknown, UNKNOWN + 1), (foreign, UNKNOWN + 2)):
            body = {**base_body(route, mine), name: given(name, value)}
            before = snapshot(db)
            response = send(client, route.method, path_of(route, mine, new_id), auth, body)
            if param.made_later:
                assert response.status_int == 200, response.text
                answers.append(repr(response.json["data"])
                               + outcome(client, auth, route, response, mine))
                # Only the caller's campaign changed.
                assert {k: v for k, v in snapshot(db).items() if k != "campaign"} == \
                    {k: v for k, v in before.items() if k != "campaign"}
            else:
                assert response.json["success"] is False, (value, response.text)
                if param.refers:   # declared: looked up as the path's ids are
                    assert response.status_int == 404, response.text
                answers.append(f"{response.status_int} {without_time(response.json['data'])}")
                assert snapshot(db) == before
        # The unknown value is no other number or word of an answer: where it
        # stands, the other account's must stand, and nothing else may differ.
        expected = answers[0].replace(str(UNKNOWN + 1), str(UNKNOWN + 2)).replace(
            str(unknown), str(foreign))
        assert answers[1] == expected, (route_id(route), name, answers)
        assert "Their Name" not in answers[1] and "their.example" not in answers[1].replace(
            "only.theirs@their.example", "")


# --- what a campaign builds never shows another account's sender ------------------------------

@pytest.fixture
def pointed(client, auth, other, world):
    """The caller's campaign, its message sending from its own address but
    with no name or reply-to of its own; ``point(profile)`` sets the
    campaign's accountprofile."""
    mine = world["mine"]
    api = Api(client, auth)
    api.post(f"/message/{mine['message']}", fromaddress="me@mine.example")

    def point(profile):
        api.post(f"/campaign/{mine['campaign']}", accountprofile=int(profile))

    return api, mine, point


SENDER_HEADERS = ("From", "Reply-To", "Sender")


def test_a_preview_never_shows_another_accounts_sender_profile(pointed, world):
    api, mine, point = pointed
    seen = {}
    for label, profile in (("unknown", UNKNOWN), ("theirs", world["theirs"]["profile"])):
        point(profile)
        headers = api.get(f"/campaign/{mine['campaign']}/preview/{mine['link']}")["preview"][
            "headers"]
        seen[label] = {name: headers.get(name) for name in SENDER_HEADERS}
    assert seen["theirs"] == seen["unknown"] == {"From": "me@mine.example", "Reply-To": None,
                                                 "Sender": None}


def test_a_test_send_never_goes_out_as_another_accounts_sender_profile(pointed, world, db,
                                                                        smtp_sink):
    api, mine, point = pointed
    for label, profile in (("unknown", UNKNOWN), ("theirs", world["theirs"]["profile"])):
        point(profile)
        assert api.put(f"/campaign/{mine['campaign']}/send/0",
                       test=[f"{label}@qa.example"]) == {"id": "0"}
    counts = campaignapi.deliver(db, smtp_sink.address)
    assert counts["failed"] == 0, counts
    arrived = smtp_sink.parsed()
    for label in ("unknown", "theirs"):
        message = arrived[f"{label}@qa.example"]
        assert str(message["From"]) == "me@mine.example", label
        assert message["Reply-To"] is None, label
    assert not any(b"their.example" in raw or b"Their Name" in raw
                   for _, _, raw in smtp_sink.messages)
    # Without an address of its own the message has none to send from, with
    # either profile: the same refusal.
    api.post(f"/message/{mine['message']}", fromaddress="")
    refusals = []
    for profile in (UNKNOWN, world["theirs"]["profile"]):
        point(profile)
        data = api.put(f"/campaign/{mine['campaign']}/send/0", status=409, test=["qa@qa.example"])
        assert data["error"] == "verification_failed"
        refusals.append(without_time(data))
    assert refusals[1] == refusals[0].replace(str(UNKNOWN), world["theirs"]["profile"])


def test_queued_emails_never_go_out_as_another_accounts_profile_named_after_the_send(
        pointed, world, db, smtp_sink):
    """Delivery reads the campaign's sender when it builds each email: a
    campaign pointed at another account's profile after its send (made, not
    yet delivered) still never sends as that profile."""
    api, mine, point = pointed
    api.put(f"/campaign/{mine['campaign']}/send/0", timestamp="2000-01-01 00:00:00")
    campaignapi.process_due(db)
    point(world["theirs"]["profile"])
    counts = campaignapi.deliver(db, smtp_sink.address)
    assert counts["sent"] >= 2 and counts["failed"] == 0, counts
    for address, message in smtp_sink.parsed().items():
        if address in ("ann@example.com", "bob@example.com"):
            assert str(message["From"]) == "me@mine.example", address
            assert message["Reply-To"] is None, address
    assert not any(b"their.example" in raw or b"Their Name" in raw
                   for _, _, raw in smtp_sink.messages)


def test_references_stored_elsewhere_read_as_missing(client, pointed, world, db, smtp_sink):
    """No route stores a reference to another account's record, but were one
    stored (an old row, a hand edit), nothing reads through it: a link to their
    message and segment, a datasource sending sign-up emails as their profile."""
    api, mine, _ = pointed
    theirs = world["theirs"]
    Api(client, world["other"]).post(f"/message/{theirs['message']}", subject="Their subject")
    with database(db) as conn, campaignapi.transaction(conn):
        conn.execute("INSERT INTO campaign_message (campaign, segment, message, priority) "
                     "VALUES (?, ?, ?, 0)", (int(mine["campaign"]), int(theirs["segment"]),
                                             int(theirs["message"])))
        conn.execute("UPDATE datasource SET signup = 1, fromprofile = ? WHERE id = ?",
                     (int(theirs["profile"]), int(mine["datasource"])))
        stray = conn.execute("SELECT max(id) FROM campaign_message").fetchone()[0]
    campaign = mine["campaign"]
    links = api.get(f"/campaign/{campaign}/message/all")["message"]
    assert [link["id"] for link in links] == [mine["link"]]
    assert api.get(f"/campaign/{campaign}/preview/{stray}", status=404)["error"] == "not_found"
    seen = [api.get(f"/campaign/{campaign}/structure/0"), api.get(f"/campaign/{campaign}/verify/0")]
    assert theirs["segment"] not in [s["segment"] for s in seen[0]["structure"]["segments"]]
    api.put(f"/campaign/{campaign}/send/0", test=["qa@qa.example"])
    api.put(f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")
    campaignapi.process_due(db)
    response = client.post_json(f"/v1/subscribe/{mine['datasource']}",
                                {"email": "new@signup.example"}, expect_errors=True)
    assert response.status_int == 200, response.text
    counts = campaignapi.deliver(db, smtp_sink.address)
    assert counts["failed"] == 0, counts
    arrived = smtp_sink.parsed()
    assert "only.theirs@their.example" not in arrived
    assert {"qa@qa.example", "ann@example.com", "new@signup.example"} <= set(arrived)
    everything = repr(seen) + "".join(raw.decode("utf-8", "replace")
                                      for _, _, raw in smtp_sink.messages)
    assert "Their subject" not in everything and "Their Name" not in everything
    assert "their.example" not in everything
