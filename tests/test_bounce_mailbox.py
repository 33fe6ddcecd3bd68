"""The bounce mailbox over IMAP, against a real dovecot on loopback
(tests/dovecot.py; the session's server, INBOX emptied per test)."""

import logging
import os
import pathlib
import socket
import ssl
import threading
import time

import pytest

from campaignapi import MailboxError, classify_bounce, read_bounce_mailbox

CORPUS = pathlib.Path(__file__).parent / "bounces"
SECRET = "corpus-test-secret"
HARD = (CORPUS / "postfix_user_unknown.eml").read_bytes().replace(b"\n", b"\r\n")
AUTO_REPLY = (CORPUS / "vacation_sieve.eml").read_bytes().replace(b"\n", b"\r\n")
JUNK = b"\x01\xff not a message \x80\x81\r\n\r\n\x1b[0m garbage \xfe\r\n"


def understood(raw):
    """What the product's handler will do: process what is a bounce."""
    return classify_bounce(raw, SECRET)["type"] != "none"


def read(server, **options):
    options.setdefault("handle", understood)
    return read_bounce_mailbox("127.0.0.1", server.port, server.user, server.password,
                               timeout=10, **options)


def test_processed_messages_are_deleted_and_the_others_left(dovecot, caplog):
    dovecot.append(HARD, JUNK, AUTO_REPLY)
    seen = []

    def handle(raw):
        seen.append(raw)
        return understood(raw)

    with caplog.at_level(logging.WARNING, logger="campaignapi"):
        assert read(dovecot, handle=handle) == {"processed": 1, "left": 2}
    assert seen == [HARD, JUNK, AUTO_REPLY]         # each message whole, in order
    assert dovecot.messages() == [JUNK, AUTO_REPLY]
    assert sum("not understood; left" in record.getMessage() for record in caplog.records) == 2
    # A second run finds the same two and leaves them again.
    assert read(dovecot) == {"processed": 0, "left": 2}


def test_a_handler_that_raises_leaves_the_message_and_logs_it(dovecot, caplog):
    dovecot.append(HARD, AUTO_REPLY, HARD)
    calls = []

    def handle(raw):
        calls.append(raw)
        if len(calls) == 1:
            raise RuntimeError("database is locked")
        return understood(raw)

    with caplog.at_level(logging.ERROR, logger="campaignapi"):
        assert read(dovecot, handle=handle) == {"processed": 1, "left": 2}
    assert len(calls) == 3
    assert dovecot.messages() == [HARD, AUTO_REPLY]
    assert any("could not be handled" in record.getMessage() and record.exc_info
               for record in caplog.records)


def test_an_empty_mailbox(dovecot):
    assert read(dovecot) == {"processed": 0, "left": 0}


def test_a_run_reads_at_most_max_messages(dovecot):
    dovecot.append(HARD, HARD, HARD)
    assert read(dovecot, max_messages=2) == {"processed": 2, "left": 1}
    assert read(dovecot, max_messages=2) == {"processed": 1, "left": 0}


def test_messages_larger_than_max_bytes_are_left_unread(dovecot):
    big = HARD + b"x" * 5000 + b"\r\n"
    dovecot.append(big, HARD)
    seen = []
    result = read(dovecot, handle=lambda raw: seen.append(raw) or True, max_bytes=len(HARD) + 100)
    assert result == {"processed": 1, "left": 1}
    assert seen == [HARD]
    assert dovecot.messages() == [big]


def test_imaps_with_a_trusted_certificate(dovecot):
    dovecot.append(HARD)
    context = ssl.create_default_context(cafile=dovecot.cert_path)
    result = read_bounce_mailbox("127.0.0.1", dovecot.ssl_port, dovecot.user, dovecot.password,
                                 ssl=True, ssl_context=context, handle=understood, timeout=10)
    assert result == {"processed": 1, "left": 0}


def test_imaps_refuses_an_untrusted_certificate(dovecot):
    with pytest.raises(MailboxError, match="cannot reach"):
        read_bounce_mailbox("127.0.0.1", dovecot.ssl_port, dovecot.user, dovecot.password,
                            ssl=True, handle=understood, timeout=10)


def test_a_wrong_password_is_a_clear_error(dovecot_server):
    # A server of its own (dovecot_server only skips where dovecot is
    # missing): after a failed login dovecot delays every later login from
    # that address by seconds, which would slow the other tests.
    from dovecot import Dovecot, session_members

    with Dovecot() as server:
        server.append(HARD)
        with pytest.raises(MailboxError, match="refused the login"):
            read_bounce_mailbox("127.0.0.1", server.port, server.user, "wrong",
                                handle=understood, timeout=10)
        # Still there: read from the maildir (LF line ends), as logging in again would wait.
        maildir = pathlib.Path(server.root, "mail", server.user)
        stored = [path.read_bytes() for path in maildir.glob("*/*") if path.is_file()]
        assert stored == [HARD.replace(b"\r\n", b"\n")]
        root, master = server.root, server.process.pid
        assert len(session_members(master)) > 1    # the master and the processes it started
    # The helper leaves nothing behind: no directory, no process of that instance.
    assert not os.path.exists(root)
    assert session_members(master) == []


@pytest.mark.parametrize("folder", ["Bounces", 'We"ird', "Ünicode", "a\r\nb"])
def test_an_unknown_or_unusable_folder_is_a_clear_error(dovecot, folder):
    with pytest.raises(MailboxError, match="folder"):
        read(dovecot, folder=folder)


def test_a_closed_port_is_a_clear_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]    # bound, not listening: connections are refused
        with pytest.raises(MailboxError, match="cannot reach"):
            read_bounce_mailbox("127.0.0.1", port, "u", "p", handle=understood, timeout=5)


def test_a_server_that_never_answers_times_out():
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(MailboxError):
            read_bounce_mailbox("127.0.0.1", listener.getsockname()[1], "u", "p",
                                handle=understood, timeout=0.5)
        assert time.monotonic() - started < 5
    finally:
        thread.join(timeout=5)
        for connection, _ in accepted:
            connection.close()
        listener.close()


def test_messages_flagged_by_an_interrupted_run_are_not_handled_again(dovecot):
    # A run that stopped after flagging but before expunging: the next run
    # neither hands the flagged message over again nor leaves it behind.
    dovecot.append(HARD, AUTO_REPLY)
    with dovecot.client() as imap:
        imap.store("1", "+FLAGS.SILENT", r"(\Deleted)")
    seen = []
    assert read(dovecot, handle=lambda raw: seen.append(raw) or understood(raw)) == {
        "processed": 0, "left": 1}
    assert seen == [AUTO_REPLY]
    assert dovecot.messages() == [AUTO_REPLY]


def test_a_password_imap_cannot_send_is_a_clear_error(dovecot):
    with pytest.raises(MailboxError, match="refused the login"):
        read_bounce_mailbox("127.0.0.1", dovecot.port, dovecot.user, "pässword",
                            handle=understood, timeout=10)
