"""Reading bounces and complaints: VERP addresses, the corpus in
tests/bounces/ (one file per real-world format), precedence rules, fuzzing."""

import pathlib
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import campaignapi
from campaignapi import classify_bounce, read_verp, verp_address

CORPUS = pathlib.Path(__file__).parent / "bounces"
#: The secret the VERP addresses in the corpus were signed with.
SECRET = "corpus-test-secret"

# What each message says, read from the message itself: (type, email, outbox
# named by its VERP address, the original's Message-ID, a fragment of the reason).
EXPECTED = {
    # RFC 3464 section 9.1: Action failed, but Status 4.0.0 (gave up on a timeout).
    "rfc3464_simple.eml": (
        "soft", "louis@larry.example.net", None, "<199407022110.RAA01234@cs.example.edu>",
        "426 connection timed out"),
    # RFC 3464 section 9.2: two failed recipients and a delayed one; the first failure counts.
    "rfc3464_multi_recipient.eml": (
        "hard", "arathib@vnet.example.com", None, "<199407081320.JAA13100@cs.example.edu>",
        "not a registered gateway user"),
    "postfix_user_unknown.eml": (
        "hard", "nobody@example.net", 4711, "<176043316001.4711.8841@worker.example.com>",
        "550 5.1.1"),
    "postfix_delayed.eml": (
        "soft", "slow@example.org", 90210, "<176052000.90210.17@worker.example.com>",
        "Connection timed out"),
    # Exim's plain-text bounce with X-Failed-Recipients (flufl.bounce's Exim detector).
    "exim_failure.eml": (
        "hard", "gone@example.org", 31337, "<176060887.31337.2@worker.example.com>",
        "User unknown"),
    # qmail's QSBMF, no DSN at all (flufl.bounce's qmail detector).
    "qmail_qsbmf.eml": (
        "hard", "ghost@example.net", 1066, "<176068980.1066.5@worker.example.com>",
        "no mailbox here by that name"),
    "sendmail_dsn.eml": (
        "hard", "baduser@example.org", None, "<176077430.555.1@worker.example.com>",
        "User unknown"),
    "office365_ndr.eml": (
        "hard", "jane@example.com", None, "<176095820.777.3@worker.example.com>",
        "5.1.10 RESOLVER.ADR.RecipientNotFound"),
    # Exchange 5.5/2000 "did not reach the following recipient(s)", no DSN.
    "exchange2000_ndr.eml": (
        "hard", "john@example.net", None, "<176104932.888.4@worker.example.com>",
        "permanent failure"),
    "gmail_dsn.eml": (
        "hard", "nosuchuser@example.com", None, "<176114047.999.6@worker.example.com>",
        "tried to reach does not exist"),
    # Yahoo's plain-text "Sorry, we were unable to deliver" (flufl.bounce's Yahoo detector).
    "yahoo_failure.eml": (
        "hard", "gone.reader@example.org", None, "<176118568.321.7@worker.example.com>",
        "User unknown"),
    # Amazon SES email feedback forwarding: SES replaces the Message-ID with its own.
    "ses_bounce.eml": (
        "hard", "nouser@example.com", None,
        "<0100019a12b3c4d5-6e7f8091-a2b3-4c5d-8e9f-0a1b2c3d4e5f-000000@email.amazonses.com>",
        "user unknown"),
    # RFC 5965 appendix B.2, the complete example (its Message-ID has no brackets).
    "arf_rfc5965.eml": (
        "complaint", "user@example.com", None, "<8787KJKJ3K4J3K4J3K4J3.mail@example.net>",
        "abuse"),
    # A mailbox provider's ARF without Original-Rcpt-To: the returned To, VERP in Original-Mail-From.
    "arf_yahoo_fbl.eml": (
        "complaint", "reader@example.net", 5150, "<176133252.5150.9@worker.example.com>",
        "abuse"),
    "microsoft_jmrp.eml": (
        "complaint", "reader2@example.org", None, "<176149860.6060.11@worker.example.com>",
        "Hotmail FBL"),
    # No known format, no returned message: only the VERP address says whose it is.
    "nonstandard_verp.eml": ("hard", None, 815, None, "5.2.1"),
    # Not bounces.
    "postfix_success_dsn.eml": (
        "none", None, 2468, "<176165280.2468.12@worker.example.com>", "successful delivery"),
    "autoreply_rfc3834.eml": (
        "none", None, 7007, "<176172930.7007.13@worker.example.com>", "automatic reply"),
    "out_of_office_outlook.eml": (
        "none", None, None, "<176181120.3003.14@worker.example.com>", "automatic reply"),
    "out_of_office_subject_only.eml": ("none", None, None, None, "automatic reply"),
    "vacation_sieve.eml": (
        "none", None, 7007, "<176192881.7007.15@worker.example.com>", "automatic reply"),
    "autoresponder_cpanel.eml": ("none", None, None, None, "automatic reply"),
    "human_reply.eml": (
        "none", None, None, "<176220000.1234.16@worker.example.com>", "not a bounce"),
}
KEYS = {"type", "email", "outbox", "message_id", "reason"}


def corpus(name):
    return (CORPUS / name).read_bytes()


def test_the_table_covers_the_corpus():
    files = {path.name for path in CORPUS.glob("*.eml")}
    assert files == set(EXPECTED)
    kinds = [expected[0] for expected in EXPECTED.values()]
    assert sum(kind != "none" for kind in kinds) >= 14 and kinds.count("none") >= 4


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("line_end", ["\n", "\r\n"], ids=["lf", "crlf"])
def test_corpus(name, line_end):
    raw = corpus(name).replace(b"\n", line_end.encode())
    result = classify_bounce(raw, SECRET)
    kind, address, outbox, message_id, reason = EXPECTED[name]
    assert set(result) == KEYS
    assert (result["type"], result["email"], result["outbox"], result["message_id"]) == (
        kind, address, outbox, message_id)
    assert reason.lower() in result["reason"].lower()
    assert len(result["reason"]) <= 200


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_without_the_secret_reads_no_verp(name):
    result = classify_bounce(corpus(name))
    assert result["outbox"] is None
    if EXPECTED[name][2] is None or EXPECTED[name][1] is not None:
        assert result["type"] == EXPECTED[name][0]
    else:
        # Only its VERP address made it a bounce.
        assert result["type"] == "none"


def test_another_services_verp_addresses_are_not_ours():
    assert classify_bounce(corpus("postfix_user_unknown.eml"), "another-secret")["outbox"] is None
    assert classify_bounce(corpus("nonstandard_verp.eml"), "another-secret")["type"] == "none"


# VERP ------------------------------------------------------------------------

@pytest.mark.parametrize("outbox", [0, 1, 4711, campaignapi.MAX_ID])
def test_verp_round_trip(outbox):
    address = verp_address(SECRET, outbox, "bounce.example.com")
    local, domain = address.split("@")
    assert domain == "bounce.example.com"
    assert re.fullmatch(r"bounces\+[0-9]+-[a-z2-7]{16}", local)   # 16 base32 characters: 80 bits
    assert len(local) <= 64 and local == local.lower()
    assert read_verp(SECRET, address) == outbox
    # Mail systems that fold the case of local parts, brackets, display names.
    assert read_verp(SECRET, address.upper()) == outbox
    assert read_verp(SECRET, f"Bounces <{address}>") == outbox
    assert read_verp(SECRET.encode(), address) == outbox


def test_verp_tokens_differ_by_secret_and_id():
    assert verp_address("a", 1, "d.example") != verp_address("b", 1, "d.example")
    assert verp_address("a", 1, "d.example").split("-")[1] != verp_address("a", 2, "d.example").split("-")[1]


def test_forged_or_altered_verp_addresses_read_as_none():
    address = verp_address(SECRET, 4711, "bounce.example.com")
    local, domain = address.split("@")
    number, mac = local[len("bounces+"):].split("-")
    flipped = mac[:-1] + ("a" if mac[-1] != "a" else "b")
    for forged in [
        verp_address("another-secret", 4711, "bounce.example.com"),
        f"bounces+4712-{mac}@{domain}",             # another email's id under this mac
        f"bounces+{number}-{flipped}@{domain}",     # one character of the mac changed
        f"bounces+{number}-{mac[:-1]}@{domain}",    # truncated mac
        f"bounces+0{number}-{mac}@{domain}",        # a second spelling of the id
        f"bounces+{number}-{mac}x@{domain}",
        f"other+{number}-{mac}@{domain}",
        f"bounces+{number}@{domain}", "bounces@bounce.example.com", "", "@", "not an address",
        f"bounces+{2**63}-{mac}@{domain}",
    ]:
        assert read_verp(SECRET, forged) is None, forged
    for not_text in (None, 4711, b"bounces+1-aaaaaaaaaaaaaaaa@x.example", ["x"]):
        assert read_verp(SECRET, not_text) is None


@pytest.mark.parametrize("bad", [-1, campaignapi.MAX_ID + 1, True, "12", 1.0, None])
def test_verp_address_refuses_what_is_no_outbox_id(bad):
    with pytest.raises(ValueError):
        verp_address(SECRET, bad, "bounce.example.com")


# Rules, on small messages written here ----------------------------------------

def dsn(*blocks, to="news@example.com", original="To: reader@example.com\nMessage-ID: <orig-1@worker.example.com>\n"):
    """A multipart/report DSN with these per-recipient blocks and the original's headers."""
    report = "\n\n".join(["Reporting-MTA: dns; mail.example.net", *blocks])
    return (f"From: MAILER-DAEMON@mail.example.net\nTo: {to}\nSubject: Returned mail\n"
            "MIME-Version: 1.0\n"
            'Content-Type: multipart/report; report-type=delivery-status; boundary="b"\n\n'
            "--b\nContent-Type: text/plain\n\nDelivery failed.\n\n"
            f"--b\nContent-Type: message/delivery-status\n\n{report}\n\n"
            f"--b\nContent-Type: text/rfc822-headers\n\n{original}\n--b--\n").encode()


@pytest.mark.parametrize("block, kind", [
    ("Final-Recipient: rfc822; a@example.com\nAction: failed\nStatus: 5.2.2", "hard"),
    ("Final-Recipient: rfc822; a@example.com\nAction: failed\nStatus: 4.4.7", "soft"),
    ("Final-Recipient: rfc822; a@example.com\nAction: delayed\nStatus: 4.2.2", "soft"),
    ("Final-Recipient: rfc822; a@example.com\nAction: failed", "hard"),
    ("Final-Recipient: rfc822; a@example.com\nAction: delayed", "soft"),
    ("Final-Recipient: rfc822; a@example.com\nAction: failed (bad address)\nStatus: 5.1.1 (user unknown)", "hard"),
    ("Final-Recipient: rfc822; a@example.com\nAction: delivered\nStatus: 2.0.0", "none"),
    ("Final-Recipient: rfc822; a@example.com\nAction: expanded\nStatus: 2.0.0", "none"),
])
def test_status_decides_hard_or_soft_and_action_whether_it_failed(block, kind):
    result = classify_bounce(dsn(block))
    assert result["type"] == kind
    assert result["email"] == ("a@example.com" if kind != "none" else None)


def test_a_hard_failure_wins_over_an_earlier_delay():
    result = classify_bounce(dsn(
        "Final-Recipient: rfc822; slow@example.com\nAction: delayed\nStatus: 4.4.1",
        "Final-Recipient: rfc822; gone@example.com\nAction: failed\nStatus: 5.1.1"))
    assert (result["type"], result["email"]) == ("hard", "gone@example.com")


def test_original_recipient_wins_over_final_recipient():
    # Forwarded: we mailed list@example.com, which forwarded to the dead address.
    result = classify_bounce(dsn("Original-Recipient: rfc822;list@example.com\n"
                                 "Final-Recipient: rfc822; old.job@example.net\n"
                                 "Action: failed\nStatus: 5.1.1"))
    assert result["email"] == "list@example.com"


def test_without_a_recipient_field_the_original_headers_name_it():
    result = classify_bounce(dsn("Action: failed\nStatus: 5.1.1"))
    assert (result["type"], result["email"]) == ("hard", "reader@example.com")
    assert result["message_id"] == "<orig-1@worker.example.com>"


def test_verp_names_the_outbox_email_even_when_the_report_names_another_address():
    to = verp_address(SECRET, 99, "bounce.example.com")
    result = classify_bounce(dsn("Final-Recipient: rfc822; alias@example.net\nAction: failed\n"
                                 "Status: 5.1.1", to=to), SECRET)
    assert (result["type"], result["outbox"], result["email"]) == ("hard", 99, "alias@example.net")


def test_addresses_are_normalized_and_invalid_ones_dropped():
    result = classify_bounce(dsn("Final-Recipient: rfc822; <Jane.Doe@EXAMPLE.com>\nAction: failed\n"
                                 "Status: 5.1.1"))
    assert result["email"] == "Jane.Doe@example.com"
    result = classify_bounce(dsn("Final-Recipient: x400; /C=US/ADMD=/PRMD=example/\nAction: failed\n"
                                 "Status: 5.1.1", original="Subject: no recipient here\n"))
    assert (result["type"], result["email"]) == ("hard", None)


def arf(feedback_type, extra=""):
    return ("From: fbl@mail.example.net\nSubject: report\nMIME-Version: 1.0\n"
            'Content-Type: multipart/report; report-type=feedback-report; boundary="b"\n\n'
            "--b\nContent-Type: text/plain\n\nA report.\n\n"
            f"--b\nContent-Type: message/feedback-report\n\nFeedback-Type: {feedback_type}\n"
            f"User-Agent: Test/1\nVersion: 1\n{extra}\n"
            "--b\nContent-Type: message/rfc822\n\nTo: reader@example.com\n"
            "Message-ID: <orig-2@worker.example.com>\n\nHello\n--b--\n").encode()


@pytest.mark.parametrize("feedback_type, kind", [
    ("abuse", "complaint"), ("fraud", "complaint"), ("not-spam", "none"), ("auth-failure", "none"),
    ("virus", "none"), ("other", "none")])
def test_only_abuse_and_fraud_reports_are_complaints(feedback_type, kind):
    result = classify_bounce(arf(feedback_type))
    assert result["type"] == kind
    assert result["message_id"] == "<orig-2@worker.example.com>"


def test_complaint_recipient_precedence():
    assert classify_bounce(arf("abuse"))["email"] == "reader@example.com"
    assert classify_bounce(arf("abuse", "Removal-Recipient: removal@example.com\n"))["email"] == \
        "removal@example.com"
    assert classify_bounce(arf("abuse", "Removal-Recipient: removal@example.com\n"
                                        "Original-Rcpt-To: <rcpt@example.com>\n"))["email"] == \
        "rcpt@example.com"


def test_a_bounce_at_a_verp_address_needs_to_look_like_one():
    to = verp_address(SECRET, 5, "bounce.example.com")
    human = f"From: Anna <anna@example.net>\nTo: {to}\nSubject: hello\n\nA note.\n".encode()
    daemon = f"From: postmaster@example.net\nTo: {to}\nSubject: note\n\nGone (4.2.1 later)\n".encode()
    assert classify_bounce(human, SECRET)[("type")] == "none"
    assert classify_bounce(human, SECRET)["outbox"] == 5
    assert classify_bounce(daemon, SECRET)["type"] == "soft"


@pytest.mark.parametrize("headers", [
    "Auto-Submitted: auto-replied", "Auto-Submitted: auto-generated", "X-Autoreply: yes",
    "X-Autorespond: hello", "Precedence: auto_reply", "Subject: Out of Office: news",
    "Subject: Automatic reply: news", "Subject: Auto: news", "Subject: =?utf-8?q?Abwesenheitsnotiz=3A?= news",
])
def test_auto_replies_are_none_even_with_bounce_words(headers):
    body = ("\n\nYour message could not be delivered to me@example.com: I am away.\n"
            "Delivery to the following recipient failed permanently:\n\n   me@example.com\n")
    raw = f"From: Bob <bob@example.com>\n{headers}\nTo: news@example.com{body}".encode()
    assert classify_bounce(raw)["type"] == "none"
    # The same words from a mailer daemon are a bounce (flufl.bounce's patterns).
    raw = f"From: MAILER-DAEMON@example.com\n{headers}\nTo: news@example.com{body}".encode()
    assert classify_bounce(raw)["type"] == "hard"


def test_8bit_headers_do_not_stop_the_detectors():
    # Raw UTF-8 in a header, as non-English mail servers write their names.
    raw = corpus("qmail_qsbmf.eml").replace(
        b"From: MAILER-DAEMON@mail.example.net",
        "From: Système de messagerie <MAILER-DAEMON@mail.example.net>".encode())
    result = classify_bounce(raw)
    assert (result["type"], result["email"]) == ("hard", "ghost@example.net")


def test_text_and_other_input_types():
    assert classify_bounce(corpus("gmail_dsn.eml").decode())["type"] == "hard"
    assert classify_bounce(bytearray(corpus("gmail_dsn.eml")))["type"] == "hard"
    for odd in (None, 42, object(), b"", b"\x00" * 100):
        result = classify_bounce(odd)
        assert set(result) == KEYS and result["type"] == "none"


def test_huge_and_deeply_nested_messages_are_refused_quickly():
    nested = b"".join(b"Content-Type: multipart/mixed; boundary=b%d\n\n--b%d\n" % (i, i)
                      for i in range(5000))
    parts = b"Content-Type: multipart/mixed; boundary=x\n\n" + b"--x\n\nhello\n" * 50000
    for raw in (nested, parts):
        assert classify_bounce(raw)["type"] == "none"
    # A bounce with a huge returned original is still read from its head.
    huge = corpus("postfix_user_unknown.eml").replace(
        b"Dear reader, here is our October news.", b"news " * 2_000_000)
    assert classify_bounce(huge, SECRET)["type"] == "hard"


# Fuzzing: any bytes give an answer -----------------------------------------

def assert_an_answer(result):
    assert set(result) == KEYS
    # internal: the bounce types the rules know
    assert result["type"] in campaignapi._BOUNCE_TYPES
    assert result["email"] is None or isinstance(result["email"], str)
    assert result["outbox"] is None or isinstance(result["outbox"], int)
    assert result["message_id"] is None or isinstance(result["message_id"], str)
    assert isinstance(result["reason"], str) and result["reason"]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000))
def test_any_bytes_give_an_answer(raw):
    assert_an_answer(classify_bounce(raw, SECRET))


@st.composite
def mutated_corpus(draw):
    raw = bytearray(corpus(draw(st.sampled_from(sorted(EXPECTED)))))
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(raw)))
        action = draw(st.sampled_from(["delete", "insert", "duplicate", "flip"]))
        if action == "delete":
            del raw[at:at + draw(st.integers(1, 400))]
        elif action == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=60) | st.sampled_from(
                [b"\n\n", b"\n--", b"Content-Type: multipart/mixed; boundary=x\n", b"=?utf-8?q?",
                 b"Action: failed\n", b"Status: 5.", b"\xff\xfe", b"<", b";", b"\r"]))
        elif action == "duplicate":
            raw[at:at] = raw[at:at + draw(st.integers(1, 400))]
        elif raw:
            raw[min(at, len(raw) - 1)] ^= draw(st.integers(1, 255))
    return bytes(raw)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_corpus())
def test_mutated_corpus_messages_give_an_answer(raw):
    assert_an_answer(classify_bounce(raw, SECRET))
