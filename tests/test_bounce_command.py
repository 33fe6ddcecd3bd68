"""The bounce mailbox end to end, against a real dovecot (tests/dovecot.py):
the ``bounces`` command, the worker's mailbox step, and the promise of the
feature -- a hard bounce that arrives a day later suppresses the address
before the next campaign.  Also the bounce options of serve and worker."""

import json
import threading

import pytest

import campaignapi
from campaignapi import process_due
from clihelpers import run_cli, served
from helpers import database, free_port, http, later, scalar, wait_for
from test_bounce_routes import (BOUNCE_DOMAIN, bounce_of, mark_sent, sent_campaign,  # noqa: F401
                                status_of)
from test_bounces import CORPUS
from test_cli_failures import refused
from test_provider_callbacks import MAILGUN_FAILED, MAILGUN_KEY, mailgun

AUTO_REPLY = (CORPUS / "vacation_sieve.eml").read_bytes()


def crlf(raw):
    return raw.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")


def mailbox_args(server):
    return ["--imap", f"127.0.0.1:{server.port}", "--user", server.user,
            "--password", server.password]


def test_done_when_a_bounce_a_day_later_suppresses_the_address_before_the_next_campaign(
        sent_campaign, smtp_sink, dovecot, api, db):
    batch = int(sent_campaign["batch"])
    with database(db) as conn, campaignapi.transaction(conn):    # the send was yesterday
        conn.execute("UPDATE outbox SET created = ?, sent = ? WHERE batch = ?",
                     (later(-86400),) * 2 + (batch,))
    dovecot.append(crlf(bounce_of(sent_campaign, smtp_sink, "bob@example.org")))

    # The worker's mailbox step (no SMTP: only batches and the mailbox run).
    stop = threading.Event()
    worker = threading.Thread(target=campaignapi.run_worker, args=(db, stop), kwargs={
        "bounce_mailbox": {"imap": f"127.0.0.1:{dovecot.port}", "user": dovecot.user,
                           "password": dovecot.password}}, daemon=True)
    worker.start()
    try:
        wait_for(lambda: status_of(db, "bob@example.org") == ["bounced"], timeout=30,
                 what="the worker to read the bounce mailbox")
    finally:
        stop.set()
        worker.join(30)
    assert not worker.is_alive()
    assert dovecot.messages() == []                               # processed, so deleted
    assert scalar(db, "SELECT count(*) FROM event WHERE kind = 'bounce' AND batch = ?", batch) == 1

    # The next campaign skips the address.
    smtp_sink.messages.clear()
    api.put(f"/campaign/{sent_campaign['campaign']}/send/0", timestamp="2000-01-01 00:00:00")
    process_due(db)
    campaignapi.deliver(db, smtp_sink.address, bounce_domain=BOUNCE_DOMAIN)
    assert sorted(rcpts[0] for _, rcpts, _ in smtp_sink.messages) == [
        "ann@example.org", "cy@example.org"]


def test_the_bounces_command_applies_and_deletes_what_it_read(sent_campaign, smtp_sink,
                                                              dovecot, db, tmp_path):
    dovecot.append(crlf(bounce_of(sent_campaign, smtp_sink, "ann@example.org")), crlf(AUTO_REPLY),
                   b"\x01\xff not a message \x80\r\n\r\n garbage\r\n")
    result = run_cli("bounces", "--db", db, *mailbox_args(dovecot), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3 processed and deleted, 0 left in INBOX"
    assert "flufl.bounce" not in result.stderr           # its INFO chatter is silenced
    assert "bounce mailbox: hard for ann@example.org" in result.stderr
    assert status_of(db, "ann@example.org") == ["bounced"]
    assert dovecot.messages() == []


@pytest.fixture
def existing(tmp_path):
    db = str(tmp_path / "existing.db")
    campaignapi.create_key(db, "owner@example.com")
    return db


def test_an_unreachable_mailbox_is_one_line_and_exit_2(existing, tmp_path):
    line = refused(tmp_path, "bounces", "--db", existing, "--imap", f"127.0.0.1:{free_port()}",
                   "--user", "u", "--password", "p")
    assert line.startswith("campaignapi bounces: error: cannot reach the IMAP server")


@pytest.mark.parametrize("args, says", [
    (["--imap", "no-port", "--user", "u", "--password", "p"], "host:port"),
    (["--user", "u", "--password", "p"], "--imap"),
    (["--imap", "127.0.0.1:143", "--password", "p"], "--user"),
    (["--imap", "127.0.0.1:143", "--user", "u", "--password", "p", "--folder", "Bo\u00eete"],
     "--folder"),
])
def test_bad_mailbox_options_are_one_line_and_exit_2(existing, tmp_path, args, says):
    assert says in refused(tmp_path, "bounces", "--db", existing, *args)


@pytest.mark.parametrize("args, says", [
    (["worker", "--user", "u"], "--imap"),
    (["serve", "--bounce-domain", "not a domain"], "--bounce-domain"),
    (["serve", "--ses-topic-arn", "arn:aws:sns:x"], "--ses-topic-arn"),
    (["serve", "--sendgrid-public-key", "bm90IGEga2V5"], "--sendgrid-public-key"),
    (["serve", "--postmark-credentials", "nocolon"], "--postmark-credentials"),
])
def test_bad_bounce_options_of_serve_and_worker_are_one_line_and_exit_2(existing, tmp_path,
                                                                        args, says):
    port = ["--port", "0"] if args[0] == "serve" else []
    assert says in refused(tmp_path, *args, "--db", existing, *port)


def test_serve_turns_a_provider_route_on_with_its_flag(tmp_path, seed_campaign, db):
    if not db.endswith(".db"):
        pytest.skip("the served process uses a SQLite file of its own")
    seeded = seed_campaign([("alice@example.com", "Alice")])
    mark_sent(db, seeded["outbox"])
    with served("--db", db, "--mailgun-signing-key", MAILGUN_KEY, cwd=tmp_path) as server:
        base = f"http://127.0.0.1:{server.port}"
        status, _, body = http(base + "/v1/bounce/mailgun", "POST", mailgun(MAILGUN_FAILED))
        assert (status, json.loads(body)["data"]) == (200, {"received": "1"})
        assert http(base + "/v1/bounce/postmark", "POST", {})[0] == 404
    assert status_of(db, "alice@example.com") == ["bounced"]


def test_a_wrong_mailbox_password_is_one_line_and_exit_2(dovecot_server, existing, tmp_path):
    # A server of its own: dovecot delays later logins after a failed one.
    from dovecot import Dovecot

    with Dovecot() as server:
        line = refused(tmp_path, "bounces", "--db", existing, "--imap",
                       f"127.0.0.1:{server.port}", "--user", server.user, "--password", "wrong")
    assert "refused the login of 'bounces'" in line


def test_the_worker_process_reads_the_mailbox_it_is_given(dovecot, existing, tmp_path):
    import subprocess
    import sys

    from clihelpers import SCRIPT

    dovecot.append(crlf(AUTO_REPLY))
    worker = subprocess.Popen([sys.executable, SCRIPT, "worker", "--db", existing,
                               *mailbox_args(dovecot)], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: dovecot.messages() == [], timeout=30, what="the worker's first read")
    finally:
        worker.terminate()
        output = worker.communicate(timeout=30)[0]
    assert f"reading the bounce mailbox at 127.0.0.1:{dovecot.port} every minute" in output
    assert "bounce mailbox: none for no known address (an automatic reply" in output
