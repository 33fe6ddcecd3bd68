"""Opens and clicks written behind their answers (issue 31): a request that
finds another thread of the app writing is answered at once and its count is
held for the thread that writes next.  Nothing answered is lost: a served
process stopped by SIGTERM, an embedding app's close(), a worker that stops,
all write what is held; statistics see them after the flush.  Both engines."""

import http.client
import os
import signal
import threading

import pytest

import campaignapi
import clihelpers
from helpers import app_secret, scalar, wait_for


@pytest.fixture
def tracked(db, seed_campaign):
    """One tracked campaign email with one link: its open and click paths."""
    seeded = seed_campaign([("ann@example.com", "Ann")])
    with campaignapi.transaction(conn := campaignapi.connect(db)):
        conn.execute("INSERT INTO batch_link (batch, message, link, url) VALUES (?, ?, 0, ?)",
                     (seeded["batch"], seeded["message"], "https://shop.example/sale"))
    conn.close()
    secret, email = app_secret(db), seeded["outbox"][0]
    return {**seeded,
            "open": f"/v1/open/{campaignapi.sign_token(secret, 'open', email)}",
            "click": f"/v1/click/{campaignapi.sign_token(secret, 'click', email, 0)}"}


def counted(db, kind=None):
    if kind is None:
        return scalar(db, "SELECT count(*) FROM event")
    return scalar(db, "SELECT count(*) FROM event WHERE kind = ?", kind)


def intake_of(app):
    # internal: the app's public writes, to stand in for a thread that is writing
    return app.config["campaignapi.service"].intake


def get(app, path):
    """A GET through the whole WSGI app: its status line."""
    import io

    statuses = []
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "SERVER_NAME": "127.0.0.1",
               "SERVER_PORT": "80", "HTTP_HOST": "127.0.0.1", "wsgi.url_scheme": "http",
               "wsgi.input": io.BytesIO(b"")}
    b"".join(app(environ, lambda status, headers, exc_info=None: statuses.append(status)))
    return statuses[0]


def held_opens(app, tracked, count, monkeypatch):
    """``count`` opens answered while another thread of the app writes: held
    in memory, and the thread that writes them made to wait an hour, so that
    only what the test calls writes them."""
    monkeypatch.setattr(campaignapi, "_HELD_INTERVAL", 3600)  # internal: no write behind
    intake = intake_of(app)
    with intake.writer:   # another thread's turn at writing
        for _ in range(count):
            assert get(app, tracked["open"]) == "200 OK"
    return intake


def test_an_open_or_click_alone_is_written_before_its_answer(app, db, tracked):
    assert get(app, tracked["open"]) == "200 OK"
    assert get(app, tracked["click"]) == "302 Found"
    assert counted(db, "open") == 1 and counted(db, "click") == 1


def test_held_opens_are_answered_first_and_written_by_close(app, db, tracked, monkeypatch):
    held_opens(app, tracked, 5, monkeypatch)
    assert counted(db) == 0   # answered, held: not written yet
    app.close()
    assert counted(db, "open") == 5
    # Closed: every later open is written in its request again.
    assert get(app, tracked["open"]) == "200 OK"
    assert counted(db, "open") == 6


def test_a_stopping_worker_writes_what_the_apps_of_its_process_hold(app, db, tracked,
                                                                   monkeypatch):
    held_opens(app, tracked, 3, monkeypatch)
    assert counted(db) == 0
    stop = threading.Event()
    worker = threading.Thread(target=campaignapi.run_worker, args=(db, stop))
    worker.start()
    stop.set()
    worker.join(60)
    assert not worker.is_alive()
    assert counted(db, "open") == 3


def test_under_load_every_count_goes_behind_even_with_the_writer_free(app, db, tracked,
                                                                     monkeypatch):
    """Once counts are written behind (the writing thread runs), a request
    that finds the writer free holds its count too: one write for many."""
    held_opens(app, tracked, 4, monkeypatch)
    assert get(app, tracked["click"]) == "302 Found"   # the writer is free now
    assert counted(db) == 0
    app.close()
    assert counted(db, "open") == 4 and counted(db, "click") == 1


def test_past_the_bound_a_request_writes_its_own_and_nothing_is_dropped(app, db, tracked,
                                                                      monkeypatch):
    monkeypatch.setattr(campaignapi, "_HELD_MAX", 2)  # internal: a small bound
    held_opens(app, tracked, 2, monkeypatch)
    intake = intake_of(app)
    answered = []
    with intake.writer:
        third = threading.Thread(target=lambda: answered.append(get(app, tracked["open"])))
        third.start()   # over the bound: it waits for its turn, as every public write did
        wait_for(lambda: intake.waiting, timeout=30, what="the third open waiting its turn")
        assert answered == []
    third.join(30)
    assert answered == ["200 OK"]
    assert counted(db, "open") == 3


def test_statistics_see_opens_and_clicks_after_the_flush(app, db, tracked, api, serve):
    """Many at once from several threads: some are held; within the flush
    interval the campaign's statistics count every one."""
    with serve(app, threads=8) as url:
        host, port = url.removeprefix("http://").split(":")
        statuses = []

        def send(share):
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            for n in range(share):
                conn.request("GET", tracked["click" if n % 4 == 0 else "open"])
                response = conn.getresponse()
                response.read()
                statuses.append(response.status)
            conn.close()

        threads = [threading.Thread(target=send, args=(40,)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert sorted(set(statuses)) == [200, 302] and len(statuses) == 320

    def archive():
        campaign = tracked["campaign"]
        return api.get(f"/campaign/{campaign}/archive/{campaign}")["archive"]

    wait_for(lambda: int(archive()["opens"]) == 240, timeout=30, what="every open counted")
    assert int(archive()["clicks"]) == 80 and int(archive()["clicked"]) == 1


def test_sigterm_to_serve_writes_every_open_and_click_it_answered(db, tracked, tmp_path,
                                                                  monkeypatch):
    """A real served process under load from 8 clients, stopped by SIGTERM:
    every open and click it answered is in the database after it ends.  Its
    thread that writes held counts never gets to (it waits an hour), so what
    is held when the signal comes is written by the stop alone."""
    script = tmp_path / "serve_held.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {clihelpers.ROOT!r})\nimport campaignapi\n"
        "campaignapi._HELD_INTERVAL = 3600\ncampaignapi.main(sys.argv[1:])\n")
    monkeypatch.setattr(clihelpers, "SCRIPT", str(script))  # internal: serve, held writes waiting
    server = clihelpers.Served("--db", db, cwd=tmp_path)
    answered = {"open": 0, "click": 0}
    lock, started = threading.Lock(), threading.Event()
    try:
        server.wait_listening()

        def client():
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            n = 0
            while True:
                kind = "click" if n % 3 == 0 else "open"
                n += 1
                try:
                    conn.request("GET", tracked[kind])
                    response = conn.getresponse()
                    response.read()
                except (OSError, http.client.HTTPException):
                    return   # the server stopped
                if response.status in (200, 302):
                    with lock:
                        answered[kind] += 1
                        if sum(answered.values()) >= 400:
                            started.set()

        clients = [threading.Thread(target=client) for _ in range(8)]
        for thread in clients:
            thread.start()
        assert started.wait(60), "the served process answered too few opens"
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0, "\n".join(server.lines)
        for thread in clients:
            thread.join(60)
    finally:
        server.stop()
    assert counted(db, "open") >= answered["open"] > 0
    assert counted(db, "click") >= answered["click"] > 0
