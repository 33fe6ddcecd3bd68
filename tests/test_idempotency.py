"""Idempotency-Key (API.md section 19): a PUT or POST with a key is done once;
a repeat gets the kept answer and changes nothing, the key with another
request is 422, a repeat while the first runs is 409 with Retry-After, a
failed request leaves its key free, keys are per account (per client address
on public routes), and the worker purges them after 24 hours.  Concurrent
repeats, from threads and from two API processes on PostgreSQL, make exactly
one effect."""

import json
import os
import threading
import time

import pytest

import campaignapi
from clihelpers import served
from conftest import serving
from helpers import (assert_envelope, assert_error, database, http, in_threads, make_datasource, make_signup_list,
                     scalar, send, snapshot, wait_for)

MESSAGE = {"name": "Reset", "subject": "Reset your password", "text": "Hello {{unsubscribe_url}}"}


def keyed(client, auth, method, path, body, key, **options):
    return send(client, method, "/v1" + path, {**auth, "Idempotency-Key": key}, body, **options)


def test_a_repeat_gets_the_kept_answer_and_changes_nothing(client, auth, db):
    first = keyed(client, auth, "PUT", "/message/0", MESSAGE, "reset-1")
    data = assert_envelope(first, True, 200)
    assert "Idempotent-Replayed" not in first.headers
    before = snapshot(db)
    again = keyed(client, auth, "PUT", "/message/0", MESSAGE, "reset-1")
    assert assert_envelope(again, True, 200) == data
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json["responseId"] != first.json["responseId"]
    assert snapshot(db) == before
    assert scalar(db, "SELECT count(*) FROM message") == 1
    # Without a key the same request makes a second message.
    assert send(client, "PUT", "/v1/message/0", auth, MESSAGE).json["data"]["id"] != data["id"]
    # A change is kept too: the repeat does not write again.
    change = keyed(client, auth, "POST", f"/message/{data['id']}", {"name": "Renamed"}, "ch-1")
    assert assert_envelope(change, True, 200) is True
    assert keyed(client, auth, "POST", f"/message/{data['id']}", {"name": "Renamed"},
                 "ch-1").headers["Idempotent-Replayed"] == "true"


def test_the_key_with_another_request_is_422_and_changes_nothing(client, auth, db):
    created = assert_envelope(keyed(client, auth, "PUT", "/message/0", MESSAGE, "k"), True, 200)
    before = snapshot(db)
    for method, path, body in [("PUT", "/message/0", {**MESSAGE, "name": "Other"}),
                               ("PUT", "/message/7", MESSAGE),
                               ("PUT", "/message/0?name=Reset", MESSAGE),
                               ("POST", f"/message/{created['id']}", MESSAGE)]:
        data = assert_error(keyed(client, auth, method, path, body, "k"), 422,
                            "idempotency_key_reused")
        assert data["field"] == "Idempotency-Key"
    assert snapshot(db) == before


def test_keys_belong_to_one_account(client, auth, other, db):
    mine = assert_envelope(keyed(client, auth, "PUT", "/message/0", MESSAGE, "same"), True, 200)
    theirs = keyed(client, other, "PUT", "/message/0", MESSAGE, "same")
    assert "Idempotent-Replayed" not in theirs.headers
    assert assert_envelope(theirs, True, 200)["id"] != mine["id"]
    assert scalar(db, "SELECT count(*) FROM message") == 2


@pytest.mark.parametrize("key", ["", " x", "x y", "a" * 256, "caf\xe9", "tab\tkey"])
def test_a_key_that_is_not_1_to_255_visible_ascii_characters_is_400(client, auth, db, key):
    before = snapshot(db)
    data = assert_error(keyed(client, auth, "PUT", "/message/0", MESSAGE, key), 400,
                        "invalid_parameter")
    assert data["field"] == "Idempotency-Key"
    assert snapshot(db) == before


def test_the_longest_key_and_every_visible_character_are_taken(client, auth):
    for key in ["a" * 255, "".join(map(chr, range(0x21, 0x7f)))]:
        assert_envelope(keyed(client, auth, "PUT", "/message/0", MESSAGE, key), True, 200)
        assert keyed(client, auth, "PUT", "/message/0", MESSAGE,
                     key).headers["Idempotent-Replayed"] == "true"


def test_a_failed_request_leaves_its_key_free(client, api, auth, db):
    # Refused after the key was claimed (the handler looks up the records
    # the parameters name): 404, and nothing is kept for the key.
    failed = keyed(client, auth, "PUT", "/segment/0", {"name": "s", "datasources": [99]}, "try-1")
    assert_error(failed, 404, "not_found")
    assert scalar(db, "SELECT count(*) FROM idempotency_key") == 0
    # The corrected request with the same key is done.
    ds = make_datasource(api)
    fixed = keyed(client, auth, "PUT", "/segment/0", {"name": "s", "datasources": [ds]}, "try-1")
    assert_envelope(fixed, True, 200)
    assert "Idempotent-Replayed" not in fixed.headers
    # A create at a taken id (409) is not kept either.
    taken = keyed(client, auth, "PUT", f"/segment/{fixed.json['data']['id']}",
                  {"name": "again", "datasources": [ds]}, "try-2")
    assert_error(taken, 409, "conflict")
    assert scalar(db, "SELECT count(*) FROM idempotency_key") == 1
    assert scalar(db, "SELECT count(*) FROM segment") == 1


def test_get_and_delete_ignore_the_header(client, auth, db):
    created = assert_envelope(keyed(client, auth, "PUT", "/message/0", MESSAGE, "g"), True, 200)
    for _ in range(2):
        answer = keyed(client, auth, "GET", f"/message/{created['id']}", None, "g")
        assert_envelope(answer, True, 200)
        assert "Idempotent-Replayed" not in answer.headers
    assert scalar(db, "SELECT count(*) FROM idempotency_key") == 1


def test_a_bounce_report_with_a_key_counts_once(client, auth, db):
    report = {"email": "gone@example.org", "type": "hard"}
    first = keyed(client, auth, "POST", "/bounce", report, "bounce-1")
    assert assert_envelope(first, True, 200)["bounce"]["type"] == "hard"
    events = scalar(db, "SELECT count(*) FROM event")
    suppressed = scalar(db, "SELECT count(*) FROM suppression")
    assert suppressed == 1
    again = keyed(client, auth, "POST", "/bounce", report, "bounce-1")
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json["data"] == first.json["data"]
    assert scalar(db, "SELECT count(*) FROM event") == events
    assert_error(keyed(client, auth, "POST", "/bounce", {**report, "type": "soft"}, "bounce-1"),
                 422, "idempotency_key_reused")


def test_public_routes_keep_keys_per_client_address(client, api, db):
    ds = make_signup_list(api, doubleoptin=0)
    body = {"email": "ann@example.org"}
    here = {"REMOTE_ADDR": "192.0.2.1"}
    first = send(client, "POST", f"/v1/subscribe/{ds}", {"Idempotency-Key": "s1"}, body,
                 environ=here)
    assert first.status_int == 200, first.text
    again = send(client, "POST", f"/v1/subscribe/{ds}", {"Idempotency-Key": "s1"}, body,
                 environ=here)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json["data"] == first.json["data"]
    assert again.headers.get("Access-Control-Allow-Origin") == \
        first.headers.get("Access-Control-Allow-Origin")
    # Another client address has keys of its own: its request is done.
    elsewhere = send(client, "POST", f"/v1/subscribe/{ds}", {"Idempotency-Key": "s1"}, body,
                     environ={"REMOTE_ADDR": "192.0.2.2"})
    assert elsewhere.status_int == 200 and "Idempotent-Replayed" not in elsewhere.headers
    with database(db) as conn:
        scopes = sorted(row[0] for row in conn.execute("SELECT scope FROM idempotency_key"))
    assert scopes == ["client:192.0.2.1", "client:192.0.2.2"]


def big_import(rows):
    return {"name": "big", "originalfile": "big.csv", "__uploadtype__": "csv",
            "__uploaddata__": "email,first\n" + "".join(f"p{i}@load.example,P{i}\n"
                                                         for i in range(rows))}


def concurrent_repeats(bases, secret, path, body, key, copies):
    """Send ``copies`` identical keyed requests at once (round robin over
    ``bases``); their (status, headers, data)."""
    results, lock, start = [], threading.Lock(), threading.Barrier(copies)
    headers = {"Authorization": f"Bearer {secret}", "Idempotency-Key": key}

    def one(number):
        start.wait(30)
        status, answer_headers, raw = http(bases[number % len(bases)] + "/v1" + path, "PUT",
                                           body, headers, timeout=120)
        with lock:
            results.append((status, answer_headers, json.loads(raw)["data"]))

    in_threads(one, range(copies), timeout=180)
    return results


def check_one_effect(results):
    """Exactly one request did the work; the others got its answer or a 409
    with Retry-After; the import's id is the same in every 200."""
    done = [r for r in results if r[0] == 200 and r[1].get("Idempotent-Replayed") is None]
    replayed = [r for r in results if r[0] == 200 and r[1].get("Idempotent-Replayed") == "true"]
    running = [r for r in results if r[0] == 409]
    assert len(done) == 1, [(r[0], r[2]) for r in results]
    assert len(done) + len(replayed) + len(running) == len(results), results
    assert {r[2]["id"] for r in done + replayed} == {done[0][2]["id"]}
    for status, headers, data in running:
        assert data["error"] == "conflict" and headers["Retry-After"] == "1"
    return done[0][2]["id"]


def test_concurrent_repeats_make_one_import(db):
    secret = campaignapi.create_key(db, "owner@example.com")
    app = campaignapi.create_app(db)
    with serving(app, threads=6) as base:
        status, _, raw = http(base + "/v1/datasource/0", "PUT", {"name": "list"},
                              {"Authorization": f"Bearer {secret}"})
        ds = json.loads(raw)["data"]["id"]
        results = concurrent_repeats([base], secret, f"/datasource/{ds}/import/0",
                                     big_import(3000), "import-once", 6)
    check_one_effect(results)
    assert scalar(db, "SELECT count(*) FROM import") == 1
    assert scalar(db, "SELECT count(*) FROM recipient") == 3000


def test_a_repeat_while_the_first_runs_is_409_with_retry_after(db):
    secret = campaignapi.create_key(db, "owner@example.com")
    app = campaignapi.create_app(db)
    headers = {"Authorization": f"Bearer {secret}", "Idempotency-Key": "slow"}
    with serving(app, threads=4) as base:
        ds = json.loads(http(base + "/v1/datasource/0", "PUT", {"name": "list"},
                             headers={"Authorization": f"Bearer {secret}"})[2])["data"]["id"]
        body, first = big_import(40000), []
        thread = threading.Thread(target=lambda: first.append(http(
            base + f"/v1/datasource/{ds}/import/0", "PUT", body, headers, timeout=300)))
        thread.start()
        try:
            wait_for(lambda: scalar(db, "SELECT count(*) FROM idempotency_key "
                                        "WHERE status IS NULL") == 1 or not thread.is_alive(),
                     timeout=60, what="the first request's claim", interval=0.005)
            status, answer_headers, raw = http(base + f"/v1/datasource/{ds}/import/0", "PUT",
                                               body, headers, timeout=300)
        finally:
            thread.join(300)
        assert first and first[0][0] == 200, first
        if scalar(db, "SELECT count(*) FROM idempotency_key WHERE status IS NULL") == 0 and \
                status == 200:   # the import ended before the repeat was read: a replay
            assert answer_headers["Idempotent-Replayed"] == "true"
            pytest.skip("the first request ended before the repeat arrived")
        assert status == 409, raw
        assert answer_headers["Retry-After"] == "1"
        assert json.loads(raw)["data"]["error"] == "conflict"
        # After it, the repeat gets the first's answer.
        status, answer_headers, raw = http(base + f"/v1/datasource/{ds}/import/0", "PUT",
                                           body, headers)
        assert status == 200 and answer_headers["Idempotent-Replayed"] == "true"
        assert json.loads(raw)["data"] == json.loads(first[0][2])["data"]
    assert scalar(db, "SELECT count(*) FROM import") == 1


def test_concurrent_repeats_of_a_create_make_one_record(db):
    # A create runs as one transaction, which claims the key itself (no
    # claim committed first): still one effect, the others replayed or 409.
    secret = campaignapi.create_key(db, "owner@example.com")
    app = campaignapi.create_app(db)
    with serving(app, threads=8) as base:
        for round_number in range(3):
            results = concurrent_repeats([base], secret, "/message/0", MESSAGE,
                                         f"create-once-{round_number}", 8)
            check_one_effect(results)
    assert scalar(db, "SELECT count(*) FROM message") == 3
    assert scalar(db, "SELECT count(*) FROM idempotency_key WHERE status = 200") == 3


@pytest.mark.skipif(os.environ.get("CAMPAIGNAPI_TEST_ENGINE") != "postgresql",
                    reason="on SQLite the repeat waits for the first's write lock "
                           "(CAMPAIGNAPI_TEST_ENGINE=postgresql)")
def test_a_repeat_while_the_first_transaction_is_open_is_409_at_once(db):
    # The first request holds its key's lock inside its transaction, where
    # it waits for a row another transaction holds: a repeat is answered 409
    # without waiting, and after the first ends it gets the first's answer.
    secret = campaignapi.create_key(db, "owner@example.com")
    app = campaignapi.create_app(db)
    headers = {"Authorization": f"Bearer {secret}", "Idempotency-Key": "change-1"}
    with serving(app, threads=4) as base:
        message = json.loads(http(base + "/v1/message/0", "PUT", MESSAGE, {
            "Authorization": f"Bearer {secret}"})[2])["data"]["id"]
        change = {"name": "Renamed"}
        first = []
        with database(db) as holder:
            holder.execute("BEGIN")
            holder.execute("SELECT id FROM message WHERE id = ? FOR UPDATE", (message,))
            thread = threading.Thread(target=lambda: first.append(http(
                base + f"/v1/message/{message}", "POST", change, headers, timeout=60)))
            thread.start()
            try:
                wait_for(lambda: scalar(db, "SELECT count(*) FROM pg_stat_activity "
                                            "WHERE wait_event_type = 'Lock'") == 1,
                         timeout=30, what="the first request to wait for the row")
                status, answer_headers, raw = http(base + f"/v1/message/{message}", "POST",
                                                   change, headers, timeout=30)
                assert status == 409, raw
                assert answer_headers["Retry-After"] == "1"
                assert not first   # it is still waiting: the repeat did not wait for it
            finally:
                holder.execute("ROLLBACK")
                thread.join(60)
        assert first and first[0][0] == 200, first
        status, answer_headers, raw = http(base + f"/v1/message/{message}", "POST", change,
                                           headers)
        assert status == 200 and answer_headers["Idempotent-Replayed"] == "true"
        assert json.loads(raw)["data"] == json.loads(first[0][2])["data"]
    assert scalar(db, "SELECT count(*) FROM idempotency_key") == 1


@pytest.mark.skipif(os.environ.get("CAMPAIGNAPI_TEST_ENGINE") != "postgresql",
                    reason="two API processes share a PostgreSQL database "
                           "(CAMPAIGNAPI_TEST_ENGINE=postgresql)")
def test_two_api_processes_make_one_effect(pg_db, tmp_path):
    with served("--db", pg_db, "--email", "owner@example.com", cwd=tmp_path) as first, \
            served("--db", pg_db, cwd=tmp_path) as second:
        bases = [f"http://127.0.0.1:{first.port}", f"http://127.0.0.1:{second.port}"]
        auth = {"Authorization": f"Bearer {first.secret}"}
        ds = json.loads(http(bases[0] + "/v1/datasource/0", "PUT", {"name": "list"},
                             auth)[2])["data"]["id"]
        for round_number in range(3):
            results = concurrent_repeats(bases, first.secret, f"/datasource/{ds}/import/0",
                                         big_import(2000), f"two-hosts-{round_number}", 6)
            check_one_effect(results)
        results = concurrent_repeats(bases, first.secret, "/message/0", MESSAGE, "msg", 8)
        check_one_effect(results)
    assert scalar(pg_db, "SELECT count(*) FROM import") == 3
    assert scalar(pg_db, "SELECT count(*) FROM message") == 1


def test_the_worker_purges_keys_after_24_hours(client, auth, db):
    assert_envelope(keyed(client, auth, "PUT", "/message/0", MESSAGE, "old"), True, 200)
    assert_envelope(keyed(client, auth, "PUT", "/message/0", MESSAGE, "new"), True, 200)
    day_ago = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(time.time() - 24 * 3600 - 5))
    with database(db) as conn, campaignapi.transaction(conn):
        conn.execute("UPDATE idempotency_key SET created = ? WHERE key = 'old'", (day_ago,))
    stop = threading.Event()
    worker = threading.Thread(target=campaignapi.run_worker, args=(db, stop),
                              kwargs={"interval": 0.05})
    worker.start()
    try:
        wait_for(lambda: scalar(db, "SELECT count(*) FROM idempotency_key") == 1,
                 timeout=30, what="the worker to purge the old key")
    finally:
        stop.set()
        worker.join(30)
    with database(db) as conn:
        assert [row[0] for row in conn.execute("SELECT key FROM idempotency_key")] == ["new"]
    # The old key is new again: another request with it is done.
    again = keyed(client, auth, "PUT", "/message/0", {**MESSAGE, "name": "Other"}, "old")
    assert assert_envelope(again, True, 200) and "Idempotent-Replayed" not in again.headers


def test_an_abandoned_claim_is_taken_over_after_its_lease(client, auth, db):
    # A claim whose request never ended (its process died) answers 409 while
    # it is young, and is taken over once it is older than the lease.
    first = keyed(client, auth, "PUT", "/message/0", MESSAGE, "lost")
    assert_envelope(first, True, 200)
    with database(db) as conn, campaignapi.transaction(conn):
        conn.execute("UPDATE idempotency_key SET status = NULL, answer = NULL")
    running = keyed(client, auth, "PUT", "/message/0", MESSAGE, "lost")
    assert_error(running, 409, "conflict")
    assert running.headers["Retry-After"] == "1"
    long_ago = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(time.time() - 3600))
    with database(db) as conn, campaignapi.transaction(conn):
        conn.execute("UPDATE idempotency_key SET created = ?", (long_ago,))
    taken = keyed(client, auth, "PUT", "/message/0", MESSAGE, "lost")
    assert_envelope(taken, True, 200)
    assert "Idempotent-Replayed" not in taken.headers
    assert scalar(db, "SELECT count(*) FROM idempotency_key WHERE status = 200") == 1
