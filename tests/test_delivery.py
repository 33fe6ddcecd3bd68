"""Delivery over SMTP to a real aiosmtpd server on loopback, also to one that
offers PIPELINING."""

import base64
import datetime
import os
import smtplib
import subprocess
import sys
import threading
import time

import pytest

import campaignapi
from helpers import account_id, database, free_port, in_threads, later, reference_fill
from smtp_sink import PipeliningSink, SmtpSink


def rows(db, sql="SELECT * FROM outbox ORDER BY id", args=()):
    with database(db) as conn:
        return [dict(row) for row in conn.execute(sql, args)]


def execute(db, sql, args=()):
    with database(db) as conn, campaignapi.transaction(conn):
        conn.execute(sql, args)


def notify(db, *emails):
    """Queue notification emails of owner@example.com's account: (to, subject, body) each."""
    account = account_id(db, "owner@example.com")
    with database(db) as conn, campaignapi.transaction(conn):
        for to, subject, body in emails:
            campaignapi.enqueue_email(conn, account, to, subject, body)


def test_campaign_email_is_mime_with_list_headers_and_escaped_values(db, smtp_sink, seed_campaign):
    ids = seed_campaign([("tom@example.org", '<b>Tom & "Jerry"</b> Zoë')],
                        subject="Hello {{name}}", replyto="replies@sender.example")
    counts = campaignapi.deliver(db, smtp_sink.address)
    assert counts["sent"] == 1 and counts["failed"] == 0
    mail_from, rcpts, raw = smtp_sink.messages[0]
    assert (mail_from, rcpts) == ("news@sender.example", ["tom@example.org"])
    assert raw.isascii()  # 7-bit clean: headers encoded, bodies quoted-printable
    message = smtp_sink.parsed()["tom@example.org"]
    assert message["From"].addresses[0].addr_spec == "news@sender.example"
    assert message["From"].addresses[0].display_name == "Profile Sender"
    assert message["To"] == "tom@example.org"
    assert message["Reply-To"] == "replies@sender.example"
    assert message["Subject"] == 'Hello <b>Tom & "Jerry"</b> Zoë'
    assert message["Message-ID"].endswith("@sender.example>")
    assert message["Date"].datetime.tzinfo is not None
    assert message["MIME-Version"] == "1.0"
    assert message["List-Id"] == f"<campaign-{ids['campaign']}.{ids['account']}.campaignapi>"
    assert message["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    link = message["List-Unsubscribe"].strip("<>")
    assert link.startswith("https://lists.example.com/email/v1/unsubscribe/")
    assert message.get_content_type() == "multipart/alternative"
    text = message.get_body(("plain",)).get_content()
    page = message.get_body(("html",)).get_content()
    assert text == f'Dear <b>Tom & "Jerry"</b> Zoë\nUnsubscribe: {link}\n'
    assert "Dear &lt;b&gt;Tom &amp; &quot;Jerry&quot;&lt;/b&gt; Zoë" in page
    assert f'<a href="{link}">' in page
    [row] = rows(db)
    assert row["status"] == "sent" and row["sent"] and row["attempts"] == 1
    assert row["claimed_by"] is None and row["error"] is None


def test_message_sender_wins_over_profile_and_long_lines_survive(db, smtp_sink, seed_campaign):
    long_line = "word " * 400
    seed_campaign([("ann@example.org", "Ann")], fromname="Shop", fromaddress="shop@shop.example",
                  html="", text=f"{long_line}\n.a line starting with a dot\n{{{{name}}}}")
    campaignapi.deliver(db, smtp_sink.address)
    message = smtp_sink.parsed()["ann@example.org"]
    assert str(message["From"]) == "Shop <shop@shop.example>"
    assert message.get_content_type() == "text/plain"
    assert message.get_content() == f"{long_line}\n.a line starting with a dot\nAnn\n"
    assert "List-Unsubscribe" in message


def test_retry_on_451_then_success(db, smtp_sink, seed_campaign):
    seed_campaign([("busy@example.org", "B"), ("fine@example.org", "F")])
    smtp_sink.replies["busy@example.org"] = ["451 4.3.0 try later"]
    counts = campaignapi.deliver(db, smtp_sink.address)
    assert (counts["sent"], counts["retried"]) == (1, 1)
    busy = rows(db, "SELECT * FROM outbox WHERE to_addr = 'busy@example.org'")[0]
    assert busy["status"] == "queued" and busy["attempts"] == 1
    assert busy["error"].startswith("451 4.3.0") and busy["next_try"] > later()
    assert campaignapi.deliver(db, smtp_sink.address)["sent"] == 0  # not due yet
    counts = campaignapi.deliver(db, smtp_sink.address, now=later(3600))
    assert counts["sent"] == 1
    busy = rows(db, "SELECT * FROM outbox WHERE to_addr = 'busy@example.org'")[0]
    assert busy["status"] == "sent" and busy["attempts"] == 2
    assert sorted(smtp_sink.parsed()) == ["busy@example.org", "fine@example.org"]


def test_4xx_fails_after_max_attempts(db, smtp_sink, seed_campaign):
    seed_campaign([("never@example.org", "N")])
    smtp_sink.always["never@example.org"] = "452 4.2.2 mailbox full"
    campaignapi.deliver(db, smtp_sink.address, max_attempts=2)
    assert rows(db)[0]["status"] == "queued"
    counts = campaignapi.deliver(db, smtp_sink.address, max_attempts=2, now=later(3600))
    assert counts["failed"] == 1
    [row] = rows(db)
    assert (row["status"], row["attempts"]) == ("failed", 2) and "452" in row["error"]


def test_550_5_1_1_marks_the_address_bounced_for_the_account(db, smtp_sink, seed_campaign):
    first = seed_campaign([("gone@example.org", "G"), ("ok@example.org", "O")])
    seed_campaign([("gone@example.org", "again")])                  # same account, other list
    seed_campaign([("gone@example.org", "x")], owner="else@example.net")  # another account
    execute(db, "UPDATE outbox SET next_try = ? WHERE batch != ?", (later(3600), first["batch"]))
    smtp_sink.always["gone@example.org"] = "550 5.1.1 no such user"
    counts = campaignapi.deliver(db, smtp_sink.address)
    assert (counts["sent"], counts["failed"], counts["bounced"]) == (1, 1, 1)
    failed = rows(db, "SELECT * FROM outbox WHERE id = ?", (first["outbox"][0],))[0]
    assert failed["status"] == "failed" and failed["error"].startswith("550 5.1.1")
    assert rows(db, "SELECT account, email, reason, campaign FROM suppression") == [
        {"account": first["account"], "email": "gone@example.org", "reason": "bounced",
         "campaign": first["campaign"]}]
    statuses = rows(db, "SELECT d.owner, r.email, r.status FROM recipient r "
                        "JOIN datasource d ON d.id = r.datasource ORDER BY r.id")
    assert [(r["owner"] == first["account"], r["email"], r["status"]) for r in statuses] == [
        (True, "gone@example.org", "bounced"), (True, "ok@example.org", "active"),
        (True, "gone@example.org", "bounced"), (False, "gone@example.org", "active")]
    # The same account's other queued email to that address is not sent.
    del smtp_sink.always["gone@example.org"]
    counts = campaignapi.deliver(db, smtp_sink.address, now=later(7200))
    assert counts["skipped"] == 1 and counts["sent"] == 1  # the other account still gets it


def test_other_5xx_fails_without_bounce(db, smtp_sink, seed_campaign):
    seed_campaign([("policy@example.org", "P")])
    smtp_sink.always["policy@example.org"] = "554 5.7.1 rejected by policy"
    counts = campaignapi.deliver(db, smtp_sink.address)
    assert (counts["failed"], counts["bounced"]) == (1, 0)
    assert rows(db, "SELECT * FROM suppression") == []
    assert rows(db, "SELECT status FROM recipient") == [{"status": "active"}]


def test_replies_at_the_end_of_data_and_421_keep_the_run_going(db, smtp_sink, seed_campaign):
    seed_campaign([("spam@example.org", "S"), ("closing@example.org", "C"),
                   ("ok@example.org", "O")])
    smtp_sink.after_data["spam@example.org"] = "554 5.7.1 looks like spam"
    smtp_sink.replies["closing@example.org"] = ["421 4.3.2 shutting down"]
    counts = campaignapi.deliver(db, smtp_sink.address)
    assert (counts["failed"], counts["retried"], counts["sent"], counts["bounced"]) == (1, 1, 1, 0)
    assert [(r["to_addr"], r["status"]) for r in rows(db)] == [
        ("spam@example.org", "failed"), ("closing@example.org", "queued"),
        ("ok@example.org", "sent")]
    assert list(smtp_sink.parsed()) == ["ok@example.org"]


def test_two_workers_in_parallel_never_send_a_row_twice(db, smtp_sink, seed_campaign):
    seed_campaign([(f"user{i}@example.org", f"U{i}") for i in range(240)])
    results = []

    def worker(name):
        results.append(campaignapi.deliver(db, smtp_sink.address, connections=2, batch_size=7,
                                           worker_id=name))

    in_threads(worker, ["w0", "w1"])
    received = [rcpts[0] for _, rcpts, _ in smtp_sink.messages]
    assert len(received) == 240 and len(set(received)) == 240
    assert sum(r["sent"] for r in results) == 240
    assert rows(db, "SELECT status, count(*) AS n FROM outbox GROUP BY status") == [
        {"status": "sent", "n": 240}]


def test_the_claim_of_a_dead_worker_is_taken_back(db, smtp_sink, seed_campaign):
    ids = seed_campaign([("stale@example.org", "S"), ("fresh@example.org", "F")])
    old = later(-20 * 60)
    execute(db, "UPDATE outbox SET status = 'sending', claimed_by = 'dead', claimed_at = ? "
                "WHERE id = ?", (old, ids["outbox"][0]))
    execute(db, "UPDATE outbox SET status = 'sending', claimed_by = 'alive', claimed_at = ? "
                "WHERE id = ?", (later(), ids["outbox"][1]))
    assert campaignapi.deliver(db, smtp_sink.address)["sent"] == 1
    assert [r["status"] for r in rows(db)] == ["sent", "sending"]
    assert list(smtp_sink.parsed()) == ["stale@example.org"]


def test_notifications_come_from_the_system_sender_as_plain_text(db, smtp_sink):
    notify(db, ("owner@example.com", "Import finished: {{x}}", "3 rows <imported>.\nDone."))
    counts = campaignapi.deliver(db, smtp_sink.address, mail_from="robot@service.example")
    assert counts["sent"] == 1
    assert smtp_sink.messages[0][0] == "robot@service.example"
    message = smtp_sink.parsed()["owner@example.com"]
    assert message["Subject"] == "Import finished: {{x}}"  # not a template
    assert message.get_content_type() == "text/plain"
    assert message.get_content() == "3 rows <imported>.\nDone.\n"
    assert "List-Unsubscribe" not in message


def test_unreachable_server_leaves_rows_queued(db, seed_campaign):
    seed_campaign([("a@example.org", "A"), ("b@example.org", "B")])
    counts = campaignapi.deliver(db, f"127.0.0.1:{free_port()}", timeout=2)
    assert counts["requeued"] == 2 and "cannot reach" in counts["error"]
    assert [(r["status"], r["attempts"]) for r in rows(db)] == [("queued", 0), ("queued", 0)]


def test_rate_limit_paces_the_emails(db, smtp_sink, seed_campaign):
    seed_campaign([(f"r{i}@example.org", "R") for i in range(6)])
    started = time.monotonic()
    assert campaignapi.deliver(db, smtp_sink.address, rate=20, connections=2)["sent"] == 6
    assert time.monotonic() - started >= 5 / 20 - 0.02


@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")
def test_login_when_configured(db, seed_campaign):
    from aiosmtpd.smtp import AuthResult

    logins = []

    def authenticator(server, session, envelope, mechanism, auth_data):
        logins.append((auth_data.login, auth_data.password))
        return AuthResult(success=auth_data.password == b"s3cret")

    sink = SmtpSink(authenticator=authenticator, auth_require_tls=False, auth_required=True).start()
    try:
        seed_campaign([("a@example.org", "A")])
        counts = campaignapi.deliver(db, sink.address)  # no login: the queue is kept
        assert counts["requeued"] == 1 and "530" in counts["error"] and sink.count() == 0
        assert rows(db)[0]["status"] == "queued"
        counts = campaignapi.deliver(db, sink.address, username="relay", password="s3cret",
                                     now=later(60))
        assert counts["sent"] == 1 and sink.count() == 1
        assert logins == [(b"relay", b"s3cret")]
    finally:
        sink.stop()


def _self_signed_certificate(directory):
    """A certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_starttls_checks_the_certificate_and_encrypts(db, seed_campaign, tmp_path, monkeypatch):
    import ssl

    cert, key = _self_signed_certificate(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    sink = SmtpSink(tls_context=context, require_starttls=True).start()
    encrypted = []
    original = sink.handle_DATA

    async def handle_data(server, session, envelope):
        encrypted.append(session.ssl is not None)
        return await original(server, session, envelope)

    sink.handle_DATA = handle_data
    try:
        seed_campaign([("tls@example.org", "T")])
        # An unknown certificate is refused: nothing is sent, the row waits.
        counts = campaignapi.deliver(db, sink.address, starttls=True)
        assert counts["requeued"] == 1 and "CERTIFICATE_VERIFY_FAILED" in counts["error"]
        monkeypatch.setenv("SSL_CERT_FILE", cert)  # trust it, as a system CA store would
        counts = campaignapi.deliver(db, sink.address, starttls=True, now=later(60))
        assert counts["sent"] == 1 and encrypted == [True]
    finally:
        sink.stop()


def _rsa_key():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.DER,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, b"v=DKIM1; k=rsa; p=" + base64.b64encode(public)


def test_dkim_signature_verifies_against_the_public_key(db, smtp_sink, seed_campaign):
    import dkim

    private, record = _rsa_key()
    seed_campaign([("signed@example.org", "Zoë <S>")])
    campaignapi.deliver(db, smtp_sink.address, dkim=("sender.example", "mail", private))
    raw = smtp_sink.messages[0][2]

    def dns(name, timeout=5):
        assert name == b"mail._domainkey.sender.example."
        return record

    assert raw.startswith(b"DKIM-Signature:")
    signature = raw.split(b"\r\n\r\n")[0]
    assert b"list-unsubscribe-post" in signature.lower()
    assert dkim.verify(raw, dnsfunc=dns)
    assert not dkim.verify(raw.replace(b"Dear", b"Deer"), dnsfunc=dns)


def test_worker_command_delivers_notifications_and_stops_on_sigterm(db, smtp_sink):
    notify(db, *[(f"n{i}@example.org", f"Note {i}", "Body") for i in range(3)])
    script = os.path.join(os.path.dirname(campaignapi.__file__), "campaignapi.py")
    process = subprocess.Popen([sys.executable, script, "worker", "--db", db, "--smtp",
                                smtp_sink.address, "--mail-from", "robot@service.example"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (
                smtp_sink.count() < 3 or rows(db, "SELECT 1 FROM outbox WHERE status != 'sent'")):
            time.sleep(0.1)
        assert smtp_sink.count() == 3
        assert {r["status"] for r in rows(db)} == {"sent"}
    finally:
        process.terminate()
        output = process.communicate(timeout=20)[0].decode()
    assert process.returncode == 0, output
    assert "delivering through" in output


@pytest.mark.parametrize("template", [
    "", "no tags", "{{name}}", "{{ Name }} and {{NAME}}{{unknown}}!", "{{name}} {x} {{ }} }}{{",
    "<a href='{{url}}'>{{name}}</a>\n", "{{name}}{{name}}"])
def test_letter_fills_merge_tags_by_the_merge_tag_rule(template):
    values = {"Name": '<Zoë & "co">', "url": "https://x/?a=1&b=2", "email": "z@example.org"}
    # internal: one email built as delivery builds it
    letter = campaignapi._Letter("a@example.com", "s", template or " ", template)
    lowered = {k.lower(): v for k, v in values.items()}
    expected_text = reference_fill(template or " ", values)
    assert letter.text.fill(lowered) == expected_text
    if template:
        assert letter.html.fill(lowered, as_html=True) == reference_fill(template, values,
                                                                              as_html=True)


def test_run_worker_delivers_only_with_smtp_and_stops_when_told(db, smtp_sink, seed_campaign):
    seed_campaign([("w@example.org", "W")])
    for smtp in (None, smtp_sink.address):
        stop = threading.Event()
        worker = threading.Thread(target=campaignapi.run_worker, args=(db, stop),
                                  kwargs={"smtp": smtp, "interval": 0.05})
        worker.start()
        deadline = time.monotonic() + 10
        while smtp and time.monotonic() < deadline and smtp_sink.count() == 0:
            time.sleep(0.02)
        time.sleep(0.1)
        stop.set()
        worker.join(5)
        assert not worker.is_alive()
        assert rows(db)[0]["status"] == ("sent" if smtp else "queued")
    assert smtp_sink.count() == 1


def test_long_deliveries_log_progress_per_interval(db, smtp_sink, seed_campaign, monkeypatch,
                                                   caplog):
    seed_campaign([(f"user{i}@example.org", f"U{i}") for i in range(30)])
    # internal: a progress line every chunk, not every 10 s
    monkeypatch.setattr(campaignapi, "_PROGRESS_INTERVAL", 0)
    with caplog.at_level("INFO", logger="campaignapi"):
        campaignapi.deliver(db, smtp_sink.address, batch_size=10)
    lines = [r.getMessage() for r in caplog.records if "delivery progress" in r.getMessage()]
    assert len(lines) == 3
    assert lines[0].startswith("delivery progress: 10 sent, 0 failed")
    assert lines[-1].endswith("30 sent and 0 failed in all; 0 still queued")


# --- a relay that offers PIPELINING -----------------------------------------------------------
# MAIL, RCPT and DATA go in one write, and every kind of refusal is still read and recorded right.

@pytest.fixture
def pipelining_sink():
    sink = PipeliningSink().start()
    yield sink
    sink.stop()


def test_the_commands_of_an_email_go_in_one_write(pipelining_sink):
    writes = []
    # internal: the --smtp value's parser
    smtp = smtplib.SMTP(*campaignapi._smtp_address(pipelining_sink.address))
    smtp.ehlo()
    send = smtp.send
    smtp.send = lambda data: (writes.append(data), send(data))
    # internal: one email's SMTP exchange, on a connection whose writes the test sees
    assert campaignapi._transact(smtp, "a@example.com", "b@example.com",
                                 b"Subject: x\r\n\r\nhi\r\n") == (None, False)
    assert writes == [b"MAIL FROM:<a@example.com>\r\nRCPT TO:<b@example.com>\r\nDATA\r\n",
                      b"Subject: x\r\n\r\nhi\r\n.\r\n"]
    # The next email's commands go with this one's final dot: one write an email.
    writes.clear()
    # internal: the commands of a transaction as one write's bytes
    then = campaignapi._offered("a@example.com", "c@example.com")
    # internal: an email whose message carries the next one's commands
    assert campaignapi._transact(smtp, "a@example.com", "b@example.com",
                                 b"Subject: y\r\n\r\nhi\r\n", then=then) == (None, True)
    # internal: the next email, its commands written already
    assert campaignapi._transact(smtp, "a@example.com", "c@example.com",
                                 b"Subject: z\r\n\r\nhi\r\n", offered=True) == (None, False)
    assert writes == [b"MAIL FROM:<a@example.com>\r\nRCPT TO:<b@example.com>\r\nDATA\r\n",
                      b"Subject: y\r\n\r\nhi\r\n.\r\n" + then,
                      b"Subject: z\r\n\r\nhi\r\n.\r\n"]
    smtp.quit()
    assert [rcpts for _, rcpts, _ in pipelining_sink.messages] == [
        ["b@example.com"], ["b@example.com"], ["c@example.com"]]


def test_over_a_pipelining_relay_an_email_is_one_write(db, pipelining_sink, seed_campaign,
                                                       monkeypatch):
    """The courier writes each email's commands with the final dot of the
    email before it, so a chunk costs one round trip an email; every email
    arrives once and is recorded sent."""
    addresses = [f"one{i}@example.org" for i in range(5)]
    seed_campaign([(address, f"O{i}") for i, address in enumerate(addresses)])
    writes = []
    send = smtplib.SMTP.send
    monkeypatch.setattr(smtplib.SMTP, "send", lambda self, data: (writes.append(data),
                                                                   send(self, data))[1])
    counts = campaignapi.deliver(db, pipelining_sink.address)
    assert counts["sent"] == 5 and counts["error"] is None
    assert [rcpts[0] for _, rcpts, _ in pipelining_sink.messages] == addresses
    assert [r["status"] for r in rows(db)] == ["sent"] * 5
    # EHLO; the first email's commands alone, then each message with the
    # next's commands, the last message alone; then QUIT.
    carrying = [w for w in writes if isinstance(w, bytes) and w.endswith(b"DATA\r\n")]
    assert len(carrying) == 5 and carrying[0].startswith(b"MAIL FROM:")
    assert all(w.split(b".\r\nMAIL FROM:")[1:] for w in carrying[1:])
    assert [w.split(b"RCPT TO:<")[1].split(b">")[0].decode() for w in carrying] == addresses
    assert len(writes) == 1 + 5 + 1 + 1


class TakingSink(PipeliningSink):
    """A pipelining relay that, while it takes one email's message, hands
    the claim of another email to another worker (as a worker looking for
    dead leases would), before it answers."""

    def __init__(self, db, when, taken):
        super().__init__()
        self.db, self.when, self.taken = db, when, taken

    async def handle_DATA(self, server, session, envelope):
        if envelope.rcpt_tos[0] == self.when:
            execute(self.db, "UPDATE outbox SET claimed_by = 'another:1' WHERE to_addr = ?",
                    (self.taken,))
        return await super().handle_DATA(server, session, envelope)


def test_an_email_whose_commands_went_ahead_is_not_sent_once_its_claim_is_lost(
        db, seed_campaign):
    """The commands of the third email go with the second's message; the
    relay hands the third's claim away before it answers that message; the
    courier finds the claim lost when it records the attempt, and hangs up
    before the third's message: it arrives nowhere, the others do."""
    addresses = [f"taken{i}@example.org" for i in range(5)]
    seed_campaign([(address, f"T{i}") for i, address in enumerate(addresses)])
    sink = TakingSink(db, addresses[1], addresses[2]).start()
    try:
        counts = campaignapi.deliver(db, sink.address)
        assert counts["sent"] == 4
        assert [rcpts[0] for _, rcpts, _ in sink.messages] == addresses[:2] + addresses[3:]
    finally:
        sink.stop()
    taken = rows(db, "SELECT status, claimed_by, attempt_started FROM outbox WHERE to_addr = ?",
                 (addresses[2],))
    assert taken == [{"status": "sending", "claimed_by": "another:1", "attempt_started": None}]


def test_refusals_retries_bounces_and_421_over_a_pipelining_relay(db, pipelining_sink,
                                                                  seed_campaign):
    sink = pipelining_sink
    seed_campaign([("busy@example.org", "B"), ("gone@example.org", "G"),
                   ("spam@example.org", "S"), ("closing@example.org", "C"),
                   ("ok@example.org", "O")])
    sink.replies["busy@example.org"] = ["451 4.3.0 try later"]
    sink.always["gone@example.org"] = "550 5.1.1 no such user"
    sink.after_data["spam@example.org"] = "554 5.7.1 looks like spam"
    sink.replies["closing@example.org"] = ["421 4.3.2 shutting down"]
    counts = campaignapi.deliver(db, sink.address)
    assert (counts["sent"], counts["retried"], counts["failed"], counts["bounced"]) == (1, 2, 2, 1)
    assert [(r["to_addr"], r["status"], (r["error"] or "")[:3]) for r in rows(db)] == [
        ("busy@example.org", "queued", "451"), ("gone@example.org", "failed", "550"),
        ("spam@example.org", "failed", "554"), ("closing@example.org", "queued", "421"),
        ("ok@example.org", "sent", "")]
    assert list(sink.parsed()) == ["ok@example.org"]
