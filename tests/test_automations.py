"""Automations (API.md section 17): the record kind and its checks, the
three triggers, the steps, runs, verify, statistics and events, and the
guarantees: a run never mails a recipient who left, a send step queues one
email per run (across a killed worker and two workers), pausing holds,
changing steps keeps the index, deleting cancels.  Both engines."""

import collections
import datetime
import email.utils
import urllib.parse

import pytest

import campaignapi
from helpers import (account_id, browse, bulk_recipients, database, import_csv, in_threads,
                     make_datasource, open_url_in, scalar, screenshot)

HTML = ("<p>Hi {{first}}</p><p><a href='https://shop.example/start'>Start</a> "
        "<a href='{{unsubscribe_url}}'>unsubscribe</a></p>")
TEXT = "Hi {{first}}\nUnsubscribe: {{unsubscribe_url}}"
T0 = "2030-01-01 10:00:00"


def later(seconds, start=T0):
    return campaignapi._shift(start, seconds)  # internal: the stored time format's arithmetic


@pytest.fixture
def world(api):
    ds = make_datasource(api, fields=[{"name": "first", "type": "text"},
                                      {"name": "birthday", "type": "date"},
                                      {"name": "stage", "type": "text"}])
    profile = api.put("/accountprofile/0", name="Shop", fromname="The Shop",
                      fromaddress="news@shop.example")["id"]
    messages = [int(api.put("/message/0", name=f"Welcome {n}", subject=f"Welcome {n}, {{{{first}}}}",
                            html=HTML, text=TEXT)["id"]) for n in (1, 2, 3)]
    return {"datasource": ds, "profile": int(profile), "messages": messages}


def welcome(api, world, **params):
    """The three-email welcome series: send, wait 2d, send, wait 3d, send."""
    m = world["messages"]
    body = {"name": "Welcome series", "datasource": world["datasource"],
            "trigger": {"type": "subscribed"}, "accountprofile": world["profile"],
            "steps": [{"send": m[0]}, {"wait": "2d"}, {"send": m[1]}, {"wait": "3d"},
                      {"send": m[2]}], **params}
    return int(api.put("/automation/0", **body)["id"])


def add(api, world, address, first="Ann", **fields):
    return int(api.put(f"/datasource/{world['datasource']}/recipient/0", email=address,
                       fields={"first": first, **fields})["id"])


def set_status(api, world, recipient, status):
    return api.call("POST", f"/datasource/{world['datasource']}/recipient/{recipient}",
                    {"status": status})


def runs(api, automation, **params):
    return api.get(f"/automation/{automation}/run/all", **params)["run"]


def queued(db, address=None):
    """Subjects of the automation emails queued, in order (to ``address``)."""
    with database(db) as conn:
        return [row[0] for row in conn.execute(
            "SELECT p.subject, o.to_addr FROM outbox o JOIN prepared p ON p.id = o.prepared "
            "WHERE o.kind = 'automation' ORDER BY o.id") if address in (None, row[1])]


def advance(db, at):
    return campaignapi.advance_runs(db, now=at)


# --- the record kind ---------------------------------------------------------------------

def test_an_automation_is_created_disabled_and_reads_back(api, world):
    automation = welcome(api, world)
    record = api.get(f"/automation/{automation}")["automation"]
    assert record["enabled"] == "0" and record["running"] == "0" and record["finished"] == "0"
    assert record["trigger"] == {"type": "subscribed"}
    assert record["steps"][1] == {"wait": 172800} and record["steps"][0] == {
        "send": world["messages"][0]}
    assert record["tracking"] == "0" and record["defaulttemplate"] == ""
    assert [a["id"] for a in api.get("/automation/all")["automation"]] == [str(automation)]
    error = api.put("/automation/0", status=400, name="x")
    assert error["error"] == "missing_parameter"


@pytest.mark.parametrize("steps, status, code", [
    ([], 400, "invalid_parameter"),
    ([{"send": 1, "wait": 5}], 400, "invalid_parameter"),
    ([{"sleep": 5}], 400, "invalid_parameter"),
    ([{"wait": "367d"}], 400, "invalid_parameter"),
    ([{"wait": "3 weeks"}], 400, "invalid_parameter"),
    ([{"send": 999}], 404, "not_found"),
    ([{"wait": 5}, {"continue_if": {"opened": 0}}], 409, "conflict"),
    ([{"continue_if": {"opened": 0}}], 409, "conflict"),
    ([{"continue_if": {"field": "nope", "op": "eq", "value": "x"}}], 409, "conflict"),
    ([{"continue_if": {"all": []}}], 400, "invalid_parameter"),
    ([{"update": {"nope": "x"}}], 400, "invalid_parameter"),
    ([{"update": {"birthday": "not a date"}}], 400, "invalid_parameter"),
    ([{"send": 1}] * 51, 400, "invalid_parameter"),
])
def test_bad_steps_are_refused_and_change_nothing(api, world, steps, status, code):
    error = api.put("/automation/0", status=status, name="x", datasource=world["datasource"],
                    trigger={"type": "api"}, accountprofile=world["profile"], steps=steps)
    assert error["error"] == code and error.get("field") in ("steps", None)
    assert api.get("/automation/all")["total"] == "0"


def test_steps_and_trigger_that_are_fine_are_stored_checked(api, world):
    m = world["messages"]
    automation = api.put("/automation/0", name="x", datasource=world["datasource"],
                         trigger={"type": "date", "field": "BIRTHDAY", "days": "-2",
                                  "yearly": True},
                         accountprofile=world["profile"], steps=[
                             {"send": m[0]}, {"wait": 90}, {"continue_if": {"not": {"any": [
                                 {"opened": 0}, {"field": "first", "op": "eq", "value": "x"}]}}},
                             {"update": {"STAGE": "done"}}])["id"]
    record = api.get(f"/automation/{automation}")["automation"]
    assert record["trigger"] == {"type": "date", "field": "birthday", "days": -2, "yearly": "1"}
    assert record["steps"][3] == {"update": {"stage": "done"}}
    for trigger in ({"type": "date", "field": "first"}, {"type": "date", "field": "nope"}):
        assert api.post(f"/automation/{automation}", status=409,
                        trigger=trigger)["error"] == "conflict"
    assert api.post(f"/automation/{automation}", status=400,
                    trigger={"type": "weekly"})["error"] == "invalid_parameter"


def test_references_of_another_account_are_not_found(api, stranger_api, world):
    theirs = stranger_api.put("/message/0", name="t", subject="s", text="t")["id"]
    error = api.put("/automation/0", status=404, name="x", datasource=world["datasource"],
                    trigger={"type": "api"}, accountprofile=world["profile"],
                    steps=[{"send": int(theirs)}])
    assert error["error"] == "not_found" and error["field"] == "steps"
    mine = welcome(api, world)
    assert stranger_api.get(f"/automation/{mine}", status=404)["error"] == "not_found"
    assert stranger_api.get(f"/automation/{mine}/run/all", status=404)["error"] == "not_found"
    assert stranger_api.get(f"/automation/{mine}/archive/0", status=404)["error"] == "not_found"


def test_enabling_runs_verify_first(api, world):
    broken = api.put("/message/0", name="no unsubscribe", subject="Hi {{nofield}}",
                     text="no link")["id"]
    automation = api.put("/automation/0", name="x", datasource=world["datasource"],
                         trigger={"type": "api"}, accountprofile=world["profile"],
                         steps=[{"send": int(broken)}])["id"]
    report = api.get(f"/automation/{automation}/verify/0")["verify"]
    failing = {check["check"] for check in report["checks"] if check["passed"] == "0"}
    assert report["passed"] == "0" and failing == {"unsubscribe_link", "merge_tags"}
    error = api.post(f"/automation/{automation}", status=409, enabled="1")
    assert error["error"] == "verification_failed" and error["checks"]
    assert api.get(f"/automation/{automation}")["automation"]["enabled"] == "0"
    error = api.put("/automation/0", status=409, name="y", datasource=world["datasource"],
                    trigger={"type": "api"}, accountprofile=world["profile"],
                    steps=[{"send": int(broken)}], enabled="1")
    assert error["error"] == "verification_failed"
    good = welcome(api, world)
    assert api.get(f"/automation/{good}/verify/0")["verify"]["passed"] == "1"
    api.post(f"/automation/{good}", enabled="1")
    assert api.get(f"/automation/{good}")["automation"]["enabled"] == "1"


# --- the welcome series, delivered ----------------------------------------------------------

def test_a_welcome_series_walks_each_recipient_through_its_steps(api, db, world, smtp_sink):
    before = add(api, world, "early@example.com", "Early")        # active before: never enters
    automation = welcome(api, world, enabled="1", tracking="1")
    ann = add(api, world, "ann@example.com")
    assert add(api, world, "cid@example.com", "Cid") and before
    [run] = runs(api, automation, recipient=ann)
    assert run["status"] == "waiting" and run["step"] == "0"
    assert len(runs(api, automation)) == 2
    assert advance(db, T0) >= 2
    assert queued(db, "ann@example.com") == ["Welcome 1, {{first}}"]
    [run] = runs(api, automation, recipient=ann)
    assert run["step"] == "2" and run["due"] == later(2 * 86400)
    assert [entry["outcome"] for entry in run["history"]] == ["sent", "waited"]
    assert advance(db, later(86400)) == 0                            # not due yet
    advance(db, later(2 * 86400))
    advance(db, later(5 * 86400))
    assert queued(db, "ann@example.com") == [f"Welcome {n}, {{{{first}}}}" for n in (1, 2, 3)]
    advance(db, later(6 * 86400))
    [run] = runs(api, automation, recipient=ann)
    assert run["status"] == "finished" and run["finished"]
    assert api.get(f"/automation/{automation}")["automation"]["finished"] == "2"
    # Delivered campaign-grade: the automation's sender, List-Id, one-click unsubscribe.
    campaignapi.deliver(db, smtp_sink.address, public_url="http://mail.example",
                        now=later(7 * 86400))
    got = [m for _, rcpts, m in smtp_sink.messages if rcpts == ["ann@example.com"]]
    assert len(got) == 3
    parsed = smtp_sink.parsed()["ann@example.com"]
    assert email.utils.parseaddr(parsed["From"]) == ("The Shop", "news@shop.example")
    assert parsed["Subject"] == "Welcome 3, Ann"
    assert parsed["List-Id"] == f"<automation-{automation}.{account_id(db, 'owner@example.com')}" \
        ".campaignapi>"
    assert parsed["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    body = parsed.get_body(("html",)).get_content()
    assert "/v1/click/" in body and "/v1/open/" in body
    # The statistics count per step.
    archive = api.get(f"/automation/{automation}/archive/0")["archive"]
    assert archive["finished"] == "2" and archive["running"] == "0"
    assert [(s["step"], s["kind"], s["sent"]) for s in archive["steps"]] == [
        ("0", "send", "2"), ("1", "wait", "0"), ("2", "send", "2"), ("3", "wait", "0"),
        ("4", "send", "2")]


def test_every_way_of_becoming_active_enters_a_subscribed_automation(api, db, world, client):
    ds = world["datasource"]
    api.post(f"/datasource/{ds}", signup="1", doubleoptin="0", fromprofile=world["profile"])
    automation = welcome(api, world, enabled="1")
    # A sign-up without double opt-in, a new address of an import, a single create.
    assert client.post_json(f"/v1/subscribe/{ds}", {"email": "sign@example.com"}).status_int == 200
    import_csv(api, ds, "email,first\nimp@example.com,Imp\n")
    add(api, world, "one@example.com")
    unconfirmed = int(api.call("PUT", f"/datasource/{ds}/recipient/0",
                               {"email": "later@example.com", "status": "unconfirmed"})["id"])
    entered = {r["recipient"] for r in runs(api, automation)}
    with database(db) as conn:
        ids = {row[1]: str(row[0]) for row in conn.execute("SELECT id, email FROM recipient")}
    assert entered == {ids["sign@example.com"], ids["imp@example.com"], ids["one@example.com"]}
    # Confirmed later (here through the API): it enters then.
    set_status(api, world, unconfirmed, "active")
    assert str(unconfirmed) in {r["recipient"] for r in runs(api, automation)}
    # Imported again (an update, not a new address): nobody enters twice.
    import_csv(api, ds, "email,first\nimp@example.com,Imp2\none@example.com,x\n")
    assert len(runs(api, automation)) == 4


def test_a_subscribed_trigger_starts_one_run_per_recipient_ever(api, db, world):
    automation = api.put("/automation/0", name="one", datasource=world["datasource"],
                         trigger={"type": "subscribed"}, accountprofile=world["profile"],
                         steps=[{"send": world["messages"][0]}], enabled="1")["id"]
    ann = add(api, world, "ann@example.com")
    advance(db, T0)
    advance(db, later(1))
    assert runs(api, automation)[0]["status"] == "finished"
    with database(db) as conn, campaignapi.transaction(conn):
        conn.execute("UPDATE recipient SET status = 'unconfirmed' WHERE id = ?", (ann,))
    set_status(api, world, ann, "active")
    assert len(runs(api, automation)) == 1


# --- the guarantees -----------------------------------------------------------------------

@pytest.mark.parametrize("leave", ["unsubscribe", "bounce", "erase", "complain", "list"])
def test_a_run_never_mails_a_recipient_who_left(api, db, world, leave):
    automation = welcome(api, world, enabled="1")
    ann = add(api, world, "ann@example.com")
    advance(db, T0)
    assert len(queued(db)) == 1
    ds = world["datasource"]
    if leave == "unsubscribe":
        set_status(api, world, ann, "unsubscribed")
    elif leave == "erase":
        api.delete(f"/datasource/{ds}/recipient/{ann}")
    elif leave == "list":   # the whole datasource is deleted
        api.delete(f"/datasource/{ds}", id=ds)
    else:
        api.post("/bounce", email="ann@example.com",
                 type="hard" if leave == "bounce" else "complaint")
    advance(db, later(2 * 86400))
    assert len(queued(db)) == 1                                    # no second email
    [run] = runs(api, automation)
    assert run["status"] == "stopped" and run["step"] == "2"
    assert run["history"][-1]["outcome"] == ("the datasource is deleted" if leave == "list" else
                                             "the recipient is no longer active")


def test_pausing_holds_runs_and_enabling_resumes_them(api, db, world):
    automation = welcome(api, world, enabled="1")
    add(api, world, "ann@example.com")
    api.post(f"/automation/{automation}", enabled="0")
    add(api, world, "bob@example.com")                            # paused: no new runs
    assert advance(db, later(10 * 86400)) == 0
    assert queued(db) == [] and len(runs(api, automation)) == 1
    api.post(f"/automation/{automation}", enabled="1")
    advance(db, later(10 * 86400))
    assert queued(db) == ["Welcome 1, {{first}}"]
    assert runs(api, automation)[0]["step"] == "2"


def test_changing_steps_continues_waiting_runs_at_the_same_index(api, db, world):
    m = world["messages"]
    automation = welcome(api, world, enabled="1")
    add(api, world, "ann@example.com")
    advance(db, T0)                                              # at step 2, due in 2 days
    new_steps = [{"send": m[0]}, {"wait": "1d"}, {"send": m[2]}, {"send": m[1]}]
    api.post(f"/automation/{automation}", steps=new_steps)
    [run] = runs(api, automation)
    assert run["status"] == "waiting" and run["step"] == "2"
    advance(db, later(2 * 86400))
    assert queued(db) == [f"Welcome {n}, {{{{first}}}}" for n in (1, 3, 2)]
    # Steps cut short: a waiting run past the new end finishes at once.
    add(api, world, "bob@example.com")
    advance(db, later(3 * 86400))                                # bob at step 2
    api.post(f"/automation/{automation}", steps=[{"send": m[0]}])
    bob = [r for r in runs(api, automation) if r["status"] != "finished" or r["step"] == "2"]
    assert {r["status"] for r in runs(api, automation)} == {"finished"}, bob


def test_deleting_cancels_waiting_runs_and_a_run_can_be_cancelled(api, db, world):
    automation = welcome(api, world, enabled="1")
    add(api, world, "ann@example.com")
    bob = add(api, world, "bob@example.com")
    advance(db, T0)
    [bob_run] = runs(api, automation, recipient=bob)
    api.delete(f"/automation/{automation}/run/{bob_run['id']}")
    assert runs(api, automation, recipient=bob)[0]["status"] == "cancelled"
    assert api.delete(f"/automation/{automation}/run/{bob_run['id']}", status=409)["error"] \
        == "conflict"
    api.delete(f"/automation/{automation}")
    assert api.get(f"/automation/{automation}")["automation"]["deleted"] == "1"
    assert {r["status"] for r in runs(api, automation)} == {"cancelled"}
    advance(db, later(30 * 86400))
    assert len(queued(db)) == 2


def test_a_run_is_started_by_hand_only_when_enabled(api, db, world):
    ann = add(api, world, "ann@example.com")
    automation = api.put("/automation/0", name="by hand", datasource=world["datasource"],
                         trigger={"type": "api"}, accountprofile=world["profile"],
                         steps=[{"send": world["messages"][0]}])["id"]
    assert api.put(f"/automation/{automation}/run/0", status=409,
                   recipient=ann)["error"] == "conflict"
    api.post(f"/automation/{automation}", enabled="1")
    run = api.put(f"/automation/{automation}/run/0", recipient=ann)["id"]
    assert api.get(f"/automation/{automation}/run/{run}")["run"]["recipient"] == str(ann)
    assert api.put(f"/automation/{automation}/run/0", status=409, recipient=ann)["error"] == \
        "conflict"                                               # one waiting run at a time
    other_ds = make_datasource(api, name="other")
    stranger = int(api.put(f"/datasource/{other_ds}/recipient/0", email="x@example.com")["id"])
    assert api.put(f"/automation/{automation}/run/0", status=404,
                   recipient=stranger)["error"] == "not_found"
    advance(db, T0)
    assert queued(db) == ["Welcome 1, {{first}}"]


def test_continue_if_and_update_steps(api, db, world, client):
    m = world["messages"]
    automation = api.put("/automation/0", name="nudge", datasource=world["datasource"],
                         trigger={"type": "subscribed"}, accountprofile=world["profile"],
                         tracking="1", enabled="1", steps=[
                             {"send": m[0]}, {"wait": "1d"},
                             {"continue_if": {"not": {"opened": 0}}},
                             {"update": {"stage": "nudged"}}, {"send": m[1]}])["id"]
    ann, bob = add(api, world, "ann@example.com"), add(api, world, "bob@example.com")
    advance(db, T0)
    campaignapi.deliver(db, "127.0.0.1:1", public_url="http://x")    # nothing listens: stays
    # Ann opens her first email (its open link names the outbox email).
    with database(db) as conn:
        outbox = conn.execute("SELECT id FROM outbox WHERE to_addr = 'ann@example.com'").fetchone()[0]
    secret = client.app.config["campaignapi.service"].secret
    client.get("/v1/open/" + campaignapi.sign_token(secret, "open", outbox))
    advance(db, later(86400))
    by = {r["recipient"]: r for r in runs(api, automation)}
    assert by[str(ann)]["status"] == "stopped"
    assert by[str(ann)]["history"][-1]["outcome"] == "the condition does not hold"
    assert by[str(bob)]["status"] == "finished" and queued(db, "bob@example.com") == [
        "Welcome 1, {{first}}", "Welcome 2, {{first}}"]
    fields = api.get(f"/datasource/{world['datasource']}/recipient/{bob}")["recipient"]["fields"]
    assert fields["stage"] == "nudged"
    archive = api.get(f"/automation/{automation}/archive/0")["archive"]
    assert archive["steps"][0]["opened"] == "1" and archive["stopped"] == "1"


def test_a_date_trigger_starts_runs_once_a_day_at_enabling_and_hourly(api, db, world):
    ds = world["datasource"]
    day = datetime.datetime.now(datetime.timezone.utc).date()
    add(api, world, "due@example.com", birthday=str(day - datetime.timedelta(days=3)))
    add(api, world, "yearly@example.com", birthday=str(day.replace(year=day.year - 30)))
    add(api, world, "not@example.com", birthday=str(day - datetime.timedelta(days=4)))
    once = api.put("/automation/0", name="3 days after", datasource=ds,
                   trigger={"type": "date", "field": "birthday", "days": 3},
                   accountprofile=world["profile"], steps=[{"send": world["messages"][0]}],
                   enabled="1")["id"]
    yearly = api.put("/automation/0", name="birthday", datasource=ds,
                     trigger={"type": "date", "field": "birthday", "days": 0, "yearly": "1"},
                     accountprofile=world["profile"], steps=[{"send": world["messages"][1]}],
                     enabled="1")["id"]
    with database(db) as conn:
        emails = {row[0]: row[1] for row in conn.execute("SELECT id, email FROM recipient")}
    assert [emails[int(r["recipient"])] for r in runs(api, once)] == ["due@example.com"]
    assert [emails[int(r["recipient"])] for r in runs(api, yearly)] == ["yearly@example.com"]
    campaignapi.advance_runs(db)
    # The hourly look of the worker starts nobody twice the same day.
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    assert campaignapi.check_dates(db, now=later(3700, now)) == 0
    assert scalar(db, "SELECT count(*) FROM automation WHERE checked IS NULL") == 0
    assert len(runs(api, once)) == 1 and len(runs(api, yearly)) == 1


def test_automation_events_are_raised_for_runs(db, world, api):
    seen = []
    app = campaignapi.create_app(db, on_event=lambda kind, payload: seen.append((kind, payload)))
    import webtest
    from conftest import Api
    events_api = Api(webtest.TestApp(app), api.headers)
    automation = welcome(events_api, world, enabled="1")
    ann = add(events_api, world, "ann@example.com")
    started = [p["data"] for k, p in seen if k == "automation.started"]
    assert [(r["automation"], r["recipient"], r["status"]) for r in started] == [
        (str(automation), str(ann), "waiting")]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    for day in (0, 2, 5):
        campaignapi.advance_runs(db, now=later(day * 86400 + 60, now),
                                 on_event=lambda kind, payload: seen.append((kind, payload)))
    finished = [p["data"] for k, p in seen if k == "automation.finished"]
    assert [(r["recipient"], r["status"]) for r in finished] == [(str(ann), "finished")]


# --- exactly one email per run: two workers, a killed worker --------------------------------

def test_two_workers_queue_each_send_step_once_per_run(api, db, world):
    automation = welcome(api, world, enabled="1")
    bulk_recipients(db, world["datasource"], 3000)
    with database(db) as conn, campaignapi.transaction(conn):
        row = conn.execute("SELECT * FROM automation WHERE id = ?", (automation,)).fetchone()
        # internal: starting runs for recipients stored by SQL (no events for them)
        campaignapi._start_runs(conn, row, None, "1 = 1", (), T0, None)
    in_threads(lambda _: campaignapi.advance_runs(db, now=T0, chunk=250), [0, 1])
    in_threads(lambda _: campaignapi.advance_runs(db, now=later(2 * 86400), chunk=250), [0, 1])
    counts = collections.Counter(queued(db))
    assert counts == {"Welcome 1, {{first}}": 3000, "Welcome 2, {{first}}": 3000}
    assert scalar(db, "SELECT count(DISTINCT to_addr) FROM outbox WHERE kind = 'automation'") \
        == 3000
    assert scalar(db, "SELECT count(*) FROM automation_run WHERE step = 4") == 3000


@pytest.mark.parametrize("chunk", [20_000, 1000])
def test_a_killed_worker_never_queues_a_send_step_twice(api, db, world, chunk):
    """SIGKILL a worker process while it advances 20,000 runs (inside its one
    transaction, or between chunks that committed): run again, every run has
    queued its email exactly once and moved past the step."""
    from test_crash_recovery import child, kill_when, wal_size

    automation = welcome(api, world, enabled="1")
    count = 20_000
    bulk_recipients(db, world["datasource"], count)
    with database(db) as conn, campaignapi.transaction(conn):
        row = conn.execute("SELECT * FROM automation WHERE id = ?", (automation,)).fetchone()
        # internal: starting runs for recipients stored by SQL (no events for them)
        campaignapi._start_runs(conn, row, None, "1 = 1", (), T0, None)
    start = wal_size(db)
    worker = child("import sys, campaignapi; campaignapi.advance_runs(sys.argv[1], now=sys.argv[2],"
                   " chunk=int(sys.argv[3]))", db, T0, str(chunk))
    if chunk == count:   # killed while its one transaction writes
        ready = lambda: wal_size(db) > start + 1_000_000                   # noqa: E731
    else:                # killed once some chunks committed
        ready = lambda: scalar(db, "SELECT count(*) FROM outbox WHERE kind = 'automation'") \
            >= 2 * chunk                                                     # noqa: E731
    assert kill_when(worker, ready), worker.communicate()
    done = scalar(db, "SELECT count(*) FROM outbox WHERE kind = 'automation'")
    moved = scalar(db, "SELECT count(*) FROM automation_run WHERE step > 0")
    assert done == moved and (done == 0 if chunk == count else 0 < done < count)
    campaignapi.advance_runs(db, now=T0)
    assert scalar(db, "SELECT count(*) FROM outbox WHERE kind = 'automation'") == count
    assert scalar(db, "SELECT count(DISTINCT lower(to_addr)) FROM outbox "
                      "WHERE kind = 'automation'") == count
    assert scalar(db, "SELECT count(*) FROM automation_run WHERE step = 2 "
                      "AND status = 'waiting'") == count


# --- the statistics as people see them ------------------------------------------------------

def test_the_statistics_page_in_the_real_browser(api, db, world, client, auth, live_server, page,
                                                 smtp_sink):
    automation = welcome(api, world, enabled="1", tracking="1")
    add(api, world, "ann@example.com")
    add(api, world, "bob@example.com", "Bob")
    advance(db, T0)
    campaignapi.deliver(db, smtp_sink.address, public_url="http://mail.example", now=T0)
    opened = open_url_in(smtp_sink.parsed()["ann@example.com"].get_body(("html",)).get_content())
    assert client.get(urllib.parse.urlsplit(opened).path).status_int == 200
    path = f"/v1/automation/{automation}/archive/0"
    assert client.get(path, headers=auth).json["data"]["archive"]["steps"][0]["opened"] == "1"
    browse(page, live_server + path, auth)
    assert page.locator("h1").inner_text() == "Welcome series: what happened"
    assert page.locator('dd[data-figure="sent"]').inner_text() == "2"
    assert page.locator('dd[data-figure="opened"]').inner_text() == "1"
    assert page.locator('dd[data-figure="opens"]').inner_text() == "1"
    assert page.locator("svg rect.opens").count() == 1
    assert "https://shop.example/start" in page.locator("td.url").all_inner_texts()
    assert page.locator('td[data-step="0"][data-figure="sent"]').inner_text() == "2"
    assert page.locator('td[data-step="0"][data-figure="opened"]').inner_text() == "1"
    assert page.locator('td[data-step="2"][data-figure="sent"]').inner_text() == "0"
    assert "2 running" in page.locator("p.runs").inner_text()
    assert page.locator("table").last.is_visible()
    assert screenshot(page, "automation-statistics.png").stat().st_size > 10_000


# --- the README's worked example ---------------------------------------------------------

def test_the_readme_welcome_series_runs_as_written(tmp_path):
    """The README's automation example, after its walk-through (whose server
    and sink it uses), runs as written: the first email of the series arrives."""
    from test_readme import between, copy_module, fenced, readme, run_walkthrough, \
        walkthrough_blocks

    walk = walkthrough_blocks()
    example = fenced(between(readme(), "<!-- automation-example", "<!-- /automation-example -->"),
                     "sh")
    assert len(example) == 2
    copy_module(tmp_path)
    returncode, output = run_walkthrough(tmp_path, walk[:-1] + example + walk[-1:])
    assert returncode == 0, output
    assert "waiting 2 ['sent', 'waited']" in output
    assert "running 1 [('send', '1'), ('wait', '0'), ('send', '0'), ('wait', '0'), " \
           "('send', '0')]" in output
    mail = (tmp_path / "mail.txt").read_text()
    assert "Subject: Welcome, Cid" in mail and "To: cid@example.org" in mail


def test_the_look_for_due_runs_reads_the_due_index_alone(db, api, world):
    """The worker's tick costs nothing with many runs waiting: its query is
    answered from the partial index on the due time (the bench measures it)."""
    welcome(api, world, enabled="1")
    with database(db) as conn:
        # internal: the tick's own query, as the worker runs it
        sql = campaignapi._DUE_RUNS
        if conn.engine == "sqlite":
            plan = " ".join(row[-1] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, (T0, 1)))
        else:
            conn.execute("SET enable_seqscan = off")   # an empty table: plan as if it were big
            plan = " ".join(row[0] for row in conn.execute("EXPLAIN " + sql, (T0, 1)))
    assert "automation_run_due" in plan, plan
