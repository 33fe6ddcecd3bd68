"""Provider bounce and complaint callbacks: Amazon SES through SNS (against a
real HTTPS certificate server on loopback), Mailgun, Postmark and SendGrid,
signed with keys the tests make."""

import base64
import copy
import datetime
import functools
import hashlib
import hmac
import json
import os
import subprocess
import sys
import time
import urllib.parse

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import campaignapi
ProviderAuthError = campaignapi._ProviderAuthError  # internal: what the parsers raise on forgery
from signedhelpers import Receiver, answer, client_context, self_signed

# Each provider's parser is tested on its own: the provider's own examples,
# forgeries and replays, more than the routes (tests/test_bounce_routes.py) show.
parse_sns = campaignapi._parse_sns_callback  # internal: the SNS parser itself
parse_mailgun = campaignapi._parse_mailgun_callback  # internal: the Mailgun parser itself
parse_postmark = campaignapi._parse_postmark_callback  # internal: the Postmark parser itself
parse_sendgrid = campaignapi._parse_sendgrid_callback  # internal: the SendGrid parser itself
load_sendgrid_public_key = campaignapi._load_sendgrid_public_key  # internal: its key forms

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)


def now_iso(offset=0):
    moment = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=offset)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


# Amazon SES through SNS -------------------------------------------------------------

TOPIC = "arn:aws:sns:us-east-1:123456789012:ses-bounces"

# Shaped like the examples in the SES developer guide.
SES_BOUNCE = {
    "notificationType": "Bounce",
    "bounce": {"bounceType": "Permanent", "bounceSubType": "General",
               "reportingMTA": "dns; email.example.com",
               "bouncedRecipients": [
                   {"emailAddress": "jane@example.com", "status": "5.1.1", "action": "failed",
                    "diagnosticCode": "smtp; 550 5.1.1 <jane@example.com>... User unknown"},
                   {"emailAddress": "richard@example.com", "status": "5.1.1",
                    "action": "failed"}],
               "timestamp": "2016-01-27T14:59:38.237Z",
               "feedbackId": "00000138111222aa-33322211-cccc-cccc-cccc-ddddaaaa068a-000000"},
    "mail": {"timestamp": "2016-01-27T14:59:38.237Z", "source": "john@example.com",
             "messageId": "00000138111222aa-33322211-cccc-cccc-cccc-ddddaaaa0680-000000",
             "destination": ["jane@example.com", "mary@example.com", "richard@example.com"]},
}
SES_COMPLAINT = {
    "notificationType": "Complaint",
    "complaint": {"userAgent": "AnyCompany Feedback Loop (V0.01)",
                  "complainedRecipients": [{"emailAddress": "richard@example.com"}],
                  "complaintFeedbackType": "abuse", "arrivalDate": "2016-01-27T14:59:38.237Z",
                  "timestamp": "2016-01-27T14:59:38.237Z",
                  "feedbackId": "000001378603177f-18c07c78-fa81-4a58-9dd1-fedc3cb8f49a-000000"},
    "mail": {"timestamp": "2016-01-27T14:59:38.237Z", "messageId": "000001378603176d-5a4b5ad9",
             "source": "john@example.com", "destination": ["richard@example.com"]},
}


#: The fields SNS signs, in this order, by message type (AWS documentation,
#: "Verifying the signatures of Amazon SNS messages"): written out from there, not taken
#: from the module, so that a wrong list in the module fails the tests.
SNS_SIGNED_FIELDS = {
    "Notification": ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"),
    "SubscriptionConfirmation": ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token",
                                 "TopicArn", "Type"),
    "UnsubscribeConfirmation": ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token",
                                "TopicArn", "Type"),
}


@functools.cache
def sns_certificates():
    """The signing certificate and the HTTPS server's, made once (RSA keys are slow)."""
    return self_signed("sns.us-east-1.amazonaws.com"), self_signed("localhost")


class Sns:
    """An SNS stand-in: its signing key and certificate, served over real HTTPS
    on loopback next to a SubscribeURL endpoint."""

    def __init__(self, tmp_path):
        (self.key, self.cert), (tls_key, self.tls_cert) = sns_certificates()
        self.server = Receiver(self.respond, tls=(tls_key, self.tls_cert), tmp_path=tmp_path)
        # internal: the HTTP client itself, on a local TLS server
        self.fetch = functools.partial(campaignapi._fetch_https, allow_private=True,
                                       context=client_context(self.tls_cert), timeout=5)
        self.pattern = rf"localhost:{self.server.port}"
        self.cert_url = f"https://localhost:{self.server.port}/SimpleNotificationService-1.pem"

    def respond(self, handler):
        if handler.path == "/SimpleNotificationService-1.pem":
            answer(handler, 200, self.cert)
        elif handler.path.startswith("/?Action=ConfirmSubscription"):
            answer(handler, 200, b"<ConfirmSubscriptionResponse/>")
        else:
            answer(handler, 404)

    def fetched(self, what):
        return [r["path"] for r in self.server.requests if what in r["path"]]

    def message(self, notification=None, *, kind="Notification", version="1", key=None,
                topic=TOPIC, subject="Amazon SES Email Event Notification", **fields):
        message = {"Type": kind, "MessageId": "22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324",
                   "TopicArn": topic, "Message": json.dumps(notification or {}),
                   "Timestamp": now_iso(), "SignatureVersion": version,
                   "SigningCertURL": self.cert_url}
        if kind == "Notification":
            if subject is not None:
                message["Subject"] = subject
            message["UnsubscribeURL"] = f"https://localhost:{self.server.port}/?Action=Unsubscribe"
        else:
            message["Message"] = "You have chosen to subscribe to the topic."
            message["Token"] = "2336412f37fb687f5d51e6e241d09c805a5a57b30d712f794cc5f6a988666d92"
            message["SubscribeURL"] = (f"https://localhost:{self.server.port}/?Action="
                                       "ConfirmSubscription&Token=2336412f37fb")
        message.update(fields)
        message["Signature"] = self.sign(message, version, key)
        return message

    def sign(self, message, version="1", key=None):
        fields = SNS_SIGNED_FIELDS[message["Type"]]
        canonical = "".join(f"{name}\n{message[name]}\n" for name in fields if name in message)
        digest = hashes.SHA1() if version == "1" else hashes.SHA256()
        signature = (key or self.key).sign(canonical.encode(), padding.PKCS1v15(), digest)
        return base64.b64encode(signature).decode()

    def read(self, message, **options):
        body = message if isinstance(message, bytes) else json.dumps(message).encode()
        return parse_sns(body, topic_arns=[TOPIC], fetch=self.fetch,
                                    cert_url_pattern=self.pattern, **options)


@pytest.fixture
def sns(tmp_path):
    stand_in = Sns(tmp_path)
    with stand_in.server:
        yield stand_in


@pytest.mark.parametrize("version", ["1", "2"])
def test_sns_bounce_is_read_with_either_signature_version(sns, version):
    events = sns.read(sns.message(SES_BOUNCE, version=version))
    message_id = SES_BOUNCE["mail"]["messageId"]
    assert events == [
        {"email": "jane@example.com", "type": "hard", "message_id": message_id,
         "reason": "smtp; 550 5.1.1 <jane@example.com>... User unknown"},
        {"email": "richard@example.com", "type": "hard", "message_id": message_id,
         "reason": "General"}]


@pytest.mark.parametrize(("bounce_type", "kind"), [("Transient", "soft"),
                                                   ("Undetermined", "soft"),
                                                   ("Permanent", "hard")])
def test_sns_bounce_types(sns, bounce_type, kind):
    notification = copy.deepcopy(SES_BOUNCE)
    notification["bounce"]["bounceType"] = bounce_type
    assert {e["type"] for e in sns.read(sns.message(notification, subject=None))} == {kind}


def test_sns_complaint_and_event_publishing_shapes(sns):
    assert sns.read(sns.message(SES_COMPLAINT)) == [
        {"email": "richard@example.com", "type": "complaint", "reason": "abuse",
         "message_id": "000001378603176d-5a4b5ad9"}]
    published = {("eventType" if k == "notificationType" else k): v
                 for k, v in SES_COMPLAINT.items()}
    assert [e["type"] for e in sns.read(sns.message(published))] == ["complaint"]
    delivery = {"notificationType": "Delivery", "mail": SES_BOUNCE["mail"], "delivery": {}}
    assert sns.read(sns.message(delivery)) == []


def test_sns_certificate_is_fetched_once(sns):
    sns.read(sns.message(SES_BOUNCE))
    sns.read(sns.message(SES_COMPLAINT, version="2"))
    assert len(sns.fetched(".pem")) == 1


def test_sns_subscription_is_confirmed(sns):
    message = sns.message(kind="SubscriptionConfirmation", version="2")
    assert sns.read(message) == []
    confirmed = sns.fetched("ConfirmSubscription")
    assert confirmed == [urllib.parse.urlsplit(message["SubscribeURL"])._replace(
        scheme="", netloc="").geturl()]
    assert sns.read(sns.message(kind="UnsubscribeConfirmation")) == []


def test_sns_subscription_url_elsewhere_is_not_fetched(sns):
    with Receiver(lambda h: answer(h, 200)) as elsewhere:
        message = sns.message(kind="SubscriptionConfirmation",
                              SubscribeURL=elsewhere.url("/?Action=ConfirmSubscription"))
        with pytest.raises(ProviderAuthError, match="SubscribeURL"):
            sns.read(message)
    assert elsewhere.connections == 0 and not sns.fetched("ConfirmSubscription")


def test_sns_confirmation_that_cannot_be_fetched_is_a_value_error(sns):
    message = sns.message(kind="SubscriptionConfirmation")
    sns.read(sns.message(SES_BOUNCE))   # the certificate is cached now
    sns.server.__exit__()
    with pytest.raises(ValueError, match="could not be confirmed"):
        sns.read(message)


def forged_cases(sns):
    other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    altered = sns.message(SES_BOUNCE)
    altered["Message"] = altered["Message"].replace("jane@", "joan@")
    unsigned = sns.message(SES_BOUNCE)
    del unsigned["Signature"]
    no_subject = sns.message(SES_BOUNCE)
    del no_subject["Subject"]
    foreign_topic = sns.message(SES_BOUNCE, topic="arn:aws:sns:us-east-1:999:theirs")
    return {
        "other key": (sns.message(SES_BOUNCE, key=other_key), "does not match"),
        "altered": (altered, "does not match"),
        "subject removed": (no_subject, "does not match"),
        "unsigned": (unsigned, "not signed"),
        "another topic": (foreign_topic, "not one accepted"),
        "too old": (sns.message(SES_BOUNCE, Timestamp=now_iso(-2 * 3600)), "minutes"),
        "version 3": (sns.message(SES_BOUNCE, SignatureVersion="3"), "SignatureVersion"),
        "not base64": (dict(sns.message(SES_BOUNCE), Signature="%%%"), "base64"),
        "http cert": (sns.message(SES_BOUNCE, SigningCertURL=sns.cert_url.replace(
            "https:", "http:")), "not an https URL"),
        "foreign cert host": (sns.message(SES_BOUNCE, SigningCertURL=(
            "https://sns.us-east-1.amazonaws.com.evil.example/x.pem")), "not an https URL"),
        "cert host with userinfo": (sns.message(SES_BOUNCE, SigningCertURL=sns.cert_url.replace(
            "https://", "https://me@")), "not an https URL"),
        "cert missing": (sns.message(SES_BOUNCE, SigningCertURL=sns.cert_url.replace(
            ".pem", "-gone.pem")), "could not be read"),
    }


def test_sns_forged_altered_replayed_and_unsigned_are_refused(sns):
    for name, (message, says) in forged_cases(sns).items():
        with pytest.raises(ProviderAuthError, match=says):
            sns.read(message)
        assert name


def test_sns_topics_given_as_one_string_are_one_topic(sns):
    message = sns.message(SES_BOUNCE, topic="arn")
    with pytest.raises(ProviderAuthError, match="not one accepted"):
        parse_sns(json.dumps(message).encode(), topic_arns=TOPIC, fetch=sns.fetch,
                             cert_url_pattern=sns.pattern)
    assert len(parse_sns(json.dumps(sns.message(SES_BOUNCE)).encode(),
                                    topic_arns=TOPIC, fetch=sns.fetch,
                                    cert_url_pattern=sns.pattern)) == 2


def test_sns_default_pattern_allows_only_amazon_hosts(sns):
    message = sns.message(SES_BOUNCE)
    with pytest.raises(ProviderAuthError, match="not an https URL of Amazon SNS"):
        parse_sns(json.dumps(message).encode(), topic_arns=[TOPIC], fetch=sns.fetch)
    assert not sns.fetched(".pem")
    for good in ("sns.eu-west-1.amazonaws.com", "sns.cn-north-1.amazonaws.com.cn"):
        # An Amazon host passes the default pattern: its certificate is read.
        url = f"https://{good}/SimpleNotificationService-{good}.pem"
        body = json.dumps(sns.message(SES_BOUNCE, SigningCertURL=url)).encode()
        asked = []
        assert parse_sns(body, topic_arns=[TOPIC],
                                    fetch=lambda wanted: asked.append(wanted) or sns.cert)
        assert asked == [url]


def test_sns_malformed_is_a_value_error(sns):
    for body in (b"", b"{", b"[]", b'"text"', b"\xff\xfe\x00", b"[" * 100000):
        with pytest.raises(ValueError):
            sns.read(body)
    with pytest.raises(ValueError, match="Type"):
        sns.read({"Type": "Other"})
    with pytest.raises(ValueError, match="Message"):
        sns.read(sns.message(SES_BOUNCE, Message="not json"))
    with pytest.raises(ValueError, match="bouncedRecipients"):
        sns.read(sns.message({"notificationType": "Bounce", "bounce": {}}))
    with pytest.raises(ValueError, match="address"):
        sns.read(sns.message({"notificationType": "Complaint",
                              "complaint": {"complainedRecipients": [{"emailAddress": 7}]}}))


def never_fetch(url):
    raise OSError(f"no fetch expected in this test ({url})")


@FUZZ
@given(body=st.binary(max_size=300))
def test_sns_any_bytes_give_events_or_a_clean_refusal(body):
    try:
        assert isinstance(parse_sns(body, topic_arns=[TOPIC], fetch=never_fetch), list)
    except (ProviderAuthError, ValueError):
        pass


@FUZZ
@given(extra=st.dictionaries(st.sampled_from(
    ["Type", "MessageId", "Message", "Timestamp", "TopicArn", "Subject", "Signature",
     "SignatureVersion", "SigningCertURL", "SubscribeURL", "Token"]), JSON, max_size=11))
def test_sns_any_json_shape_gives_a_clean_refusal(extra):
    message = {"Type": "Notification", "MessageId": "m", "Message": "{}", "TopicArn": TOPIC,
               "Timestamp": now_iso(), **extra}
    with pytest.raises((ProviderAuthError, ValueError)):
        parse_sns(json.dumps(message).encode(), topic_arns=[TOPIC], fetch=never_fetch)


# Mailgun ---------------------------------------------------------------------------

MAILGUN_KEY = "key-3ax6xnjp29jd6fds4gc373sgvjxteol0"


def mailgun(event_data, key=MAILGUN_KEY, timestamp=None, token="a8ce0edb2dd8301dee6c2405235584e45aa91d1e9f979f3de0"):
    timestamp = str(int(time.time()) if timestamp is None else timestamp)
    signature = hmac.new(key.encode(), (timestamp + token).encode(), hashlib.sha256).hexdigest()
    return {"signature": {"timestamp": timestamp, "token": token, "signature": signature},
            "event-data": event_data}


# Shaped like Mailgun's webhook examples.
MAILGUN_FAILED = {
    "id": "G9Bn5sl1TC6nu79C8C0bwg", "timestamp": 1521233195.375624, "event": "failed",
    "severity": "permanent", "reason": "suppress-bounce", "log-level": "error",
    "recipient": "alice@example.com", "recipient-domain": "example.com",
    "delivery-status": {"attempt-no": 1, "code": 605, "message": "",
                        "description": "Not delivering to previously bounced address"},
    "message": {"headers": {"to": "Alice <alice@example.com>",
                            "message-id": "20130503192659.13651.20287@example.com",
                            "from": "Bob <bob@example.com>", "subject": "Test"}},
}


def mailgun_events(call, key=MAILGUN_KEY):
    return parse_mailgun(json.dumps(call).encode(), key)


def test_mailgun_failures_and_complaints():
    assert mailgun_events(mailgun(MAILGUN_FAILED)) == [
        {"email": "alice@example.com", "type": "hard",
         "reason": "Not delivering to previously bounced address",
         "message_id": "20130503192659.13651.20287@example.com"}]
    temporary = dict(MAILGUN_FAILED, severity="temporary")
    assert [e["type"] for e in mailgun_events(mailgun(temporary))] == ["soft"]
    complained = {"event": "complained", "recipient": "alice@example.com",
                  "message": MAILGUN_FAILED["message"]}
    assert [e["type"] for e in mailgun_events(mailgun(complained))] == ["complaint"]
    assert mailgun_events(mailgun({"event": "delivered", "recipient": "alice@example.com"})) == []


def test_mailgun_forged_replayed_and_unsigned_are_refused():
    good = mailgun(MAILGUN_FAILED)
    wrong_token = copy.deepcopy(good)
    wrong_token["signature"]["token"] += "x"
    cases = {
        "other key": (mailgun(MAILGUN_FAILED, key="key-other"), "does not match"),
        "token altered": (wrong_token, "does not match"),
        "too old": (mailgun(MAILGUN_FAILED, timestamp=int(time.time()) - 16 * 60), "minutes"),
        "from the future": (mailgun(MAILGUN_FAILED, timestamp=int(time.time()) + 3600), "minutes"),
        "unsigned": ({"event-data": MAILGUN_FAILED}, "not signed"),
        "no token": ({"signature": {"timestamp": "1", "signature": "ab"},
                      "event-data": MAILGUN_FAILED}, "token"),
        "non-ascii signature": (dict(good, signature=dict(good["signature"], signature="é")),
                                "does not match"),
    }
    for name, (call, says) in cases.items():
        with pytest.raises(ProviderAuthError, match=says):
            mailgun_events(call)
        assert name


def test_mailgun_and_postmark_without_configured_secrets_refuse_everything():
    unkeyed = mailgun(MAILGUN_FAILED, key="")
    with pytest.raises(ProviderAuthError, match="configured"):
        mailgun_events(unkeyed, key="")
    with pytest.raises(ProviderAuthError, match="configured"):
        parse_postmark(json.dumps(POSTMARK_BOUNCE).encode(), "Basic Og==", "")


def test_mailgun_malformed_is_a_value_error():
    for body in (b"", b"nope", b"[1]"):
        with pytest.raises(ValueError):
            parse_mailgun(body, MAILGUN_KEY)
    with pytest.raises(ValueError, match="event-data"):
        mailgun_events(mailgun("not an object"))
    with pytest.raises(ValueError, match="address"):
        mailgun_events(mailgun(dict(MAILGUN_FAILED, recipient=None)))


@FUZZ
@given(body=st.binary(max_size=300))
def test_mailgun_any_bytes(body):
    try:
        assert isinstance(parse_mailgun(body, MAILGUN_KEY), list)
    except (ProviderAuthError, ValueError):
        pass


@FUZZ
@given(event_data=JSON, signature=JSON)
def test_mailgun_any_json_shape(event_data, signature):
    for call in (mailgun(event_data), {"signature": signature, "event-data": event_data}):
        try:
            assert isinstance(mailgun_events(call), list)
        except (ProviderAuthError, ValueError):
            pass


# Postmark --------------------------------------------------------------------------

CREDENTIALS = "postmark:s3cr:et"
AUTH = "Basic " + base64.b64encode(CREDENTIALS.encode()).decode()

# Shaped like Postmark's bounce webhook example.
POSTMARK_BOUNCE = {
    "RecordType": "Bounce", "MessageStream": "outbound", "ID": 4323372036854775807,
    "Type": "HardBounce", "TypeCode": 1, "Name": "Hard bounce", "Tag": "Invitation",
    "MessageID": "883953f4-6105-42a2-a16a-77a8eac79483", "ServerID": 23,
    "Description": "The server was unable to deliver your message (ex: unknown user, mailbox"
                   " not found).",
    "Details": "Test bounce details", "Email": "john@example.com", "From": "sender@example.com",
    "BouncedAt": "2019-11-05T16:33:54.9070259Z", "DumpAvailable": True, "Inactive": True,
    "CanActivate": True, "Subject": "Test subject", "Content": "<Full dump of bounce>",
}


def postmark_events(record, authorization=AUTH):
    return parse_postmark(json.dumps(record).encode(), authorization, CREDENTIALS)


@pytest.mark.parametrize(("bounce_type", "kind"), [
    ("HardBounce", "hard"), ("BadEmailAddress", "hard"), ("SoftBounce", "soft"),
    ("Transient", "soft"), ("DnsError", "soft"), ("Blocked", "soft"),
    ("SpamComplaint", "complaint"), ("AutoResponder", None), ("OpenRelayTest", None),
    ("Subscribe", None), ("DMARCPolicy", None)])
def test_postmark_bounce_types(bounce_type, kind):
    events = postmark_events(dict(POSTMARK_BOUNCE, Type=bounce_type))
    assert [e["type"] for e in events] == ([kind] if kind else [])
    if kind:
        assert events[0]["email"] == "john@example.com"
        assert events[0]["message_id"] == "883953f4-6105-42a2-a16a-77a8eac79483"


def test_postmark_spam_complaint_and_other_records():
    complaint = dict(POSTMARK_BOUNCE, RecordType="SpamComplaint", Type="SpamComplaint",
                     TypeCode=512)
    assert postmark_events(complaint)[0]["type"] == "complaint"
    assert postmark_events({"RecordType": "Delivery", "Recipient": "john@example.com"}) == []


@pytest.mark.parametrize("authorization", [
    None, "", "Basic", "Basic !!!", "Bearer " + AUTH.split()[1],
    "Basic " + base64.b64encode(b"postmark:wrong").decode(),
    "Basic " + base64.b64encode(CREDENTIALS.encode() + b"x").decode()])
def test_postmark_without_the_credentials_is_refused(authorization):
    with pytest.raises(ProviderAuthError):
        postmark_events(POSTMARK_BOUNCE, authorization)


def test_postmark_scheme_is_case_insensitive_and_malformed_is_a_value_error():
    assert postmark_events(POSTMARK_BOUNCE, "basic " + AUTH.split()[1])[0]["type"] == "hard"
    for body in (b"", b"{", b"[]"):
        with pytest.raises(ValueError):
            parse_postmark(body, AUTH, CREDENTIALS)
    with pytest.raises(ValueError, match="address"):
        postmark_events(dict(POSTMARK_BOUNCE, Email=""))


@FUZZ
@given(body=st.binary(max_size=300), record=JSON)
def test_postmark_any_bytes_and_shapes(body, record):
    for call in (body, json.dumps(record).encode()):
        try:
            assert isinstance(parse_postmark(call, AUTH, CREDENTIALS), list)
        except ValueError:
            pass


# SendGrid --------------------------------------------------------------------------

SENDGRID_KEY = ec.generate_private_key(ec.SECP256R1())
SENDGRID_PUBLIC = base64.b64encode(SENDGRID_KEY.public_key().public_bytes(
    serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)).decode()

# Shaped like SendGrid's event webhook reference.
SENDGRID_EVENTS = [
    {"email": "example@test.com", "timestamp": 1513299569, "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>",
     "event": "bounce", "category": "cat facts", "sg_event_id": "6g4ZI7SA-xmRDv57GoPIPw==",
     "sg_message_id": "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0",
     "reason": "500 unknown recipient", "status": "5.0.0", "type": "bounce"},
    {"email": "blocked@test.com", "timestamp": 1513299569, "event": "bounce",
     "sg_message_id": "14c5d75ce93.dfd.64b469.filter0001", "reason": "550 blocked by policy",
     "status": "5.7.1", "type": "blocked"},
    {"email": "dropped@test.com", "timestamp": 1513299569, "event": "dropped",
     "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-556>", "reason": "Bounced Address",
     "status": "5.0.0"},
    {"email": "unsub@test.com", "timestamp": 1513299569, "event": "dropped",
     "reason": "Unsubscribed Address", "status": "5.0.0"},
    {"email": "spam@test.com", "timestamp": 1513299569, "event": "spamreport",
     "sg_message_id": "14c5d75ce93.dfd.64b469.filter0002"},
    {"email": "open@test.com", "timestamp": 1513299569, "event": "open", "ip": "255.255.255.255"},
]


def sendgrid(events=SENDGRID_EVENTS, key=SENDGRID_KEY, timestamp=None):
    body = json.dumps(events).encode()
    timestamp = str(int(time.time()) if timestamp is None else timestamp)
    signature = key.sign(timestamp.encode() + body, ec.ECDSA(hashes.SHA256()))
    return body, base64.b64encode(signature).decode(), timestamp


def test_sendgrid_events_with_the_key_as_base64_der_and_as_pem():
    pem = SENDGRID_KEY.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    for public in (SENDGRID_PUBLIC, pem, load_sendgrid_public_key(SENDGRID_PUBLIC)):
        events = parse_sendgrid(*sendgrid(), public)
        assert [(e["email"], e["type"]) for e in events] == [
            ("example@test.com", "hard"), ("blocked@test.com", "soft"),
            ("dropped@test.com", "hard"), ("spam@test.com", "complaint")]
    assert events[0] == {"email": "example@test.com", "type": "hard",
                         "reason": "500 unknown recipient",
                         "message_id": "<14c5d75ce93.dfd.64b469@ismtpd-555>"}


def test_sendgrid_forged_altered_replayed_and_unsigned_are_refused():
    body, signature, timestamp = sendgrid()
    other = ec.generate_private_key(ec.SECP256R1())
    cases = {
        "other key": (sendgrid(key=other), "does not match"),
        "body altered": ((body.replace(b"example@", b"exomple@"), signature, timestamp),
                         "does not match"),
        "timestamp altered": ((body, signature, str(int(timestamp) + 1)), "does not match"),
        "too old": (sendgrid(timestamp=int(time.time()) - 16 * 60), "minutes"),
        "no signature": ((body, "", timestamp), "not signed"),
        "no timestamp": ((body, signature, None), "not signed"),
        "not base64": ((body, "@@@", timestamp), "base64"),
        "not a number": ((body, signature, "12a"), "not a number"),
        "not DER": ((body, base64.b64encode(b"junk").decode(), timestamp), "does not match"),
    }
    for name, (call, says) in cases.items():
        with pytest.raises(ProviderAuthError, match=says):
            parse_sendgrid(*call, SENDGRID_PUBLIC)
        assert name


def test_sendgrid_malformed_is_a_value_error():
    for events in ({"event": "bounce"}, [1], [{"event": "bounce", "email": None}]):
        with pytest.raises(ValueError):
            parse_sendgrid(*sendgrid(events), SENDGRID_PUBLIC)
    with pytest.raises(ValueError, match="not JSON"):
        parse_sendgrid(b"{", *_sign(b"{"), SENDGRID_PUBLIC)


def _sign(body):
    timestamp = str(int(time.time()))
    signature = SENDGRID_KEY.sign(timestamp.encode() + body, ec.ECDSA(hashes.SHA256()))
    return base64.b64encode(signature).decode(), timestamp


@pytest.mark.parametrize("key", [
    "", "not base64 !", base64.b64encode(b"junk").decode(),
    base64.b64encode(ec.generate_private_key(ec.SECP384R1()).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)).decode(),
    "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"])
def test_sendgrid_bad_keys_are_refused_when_loaded(key):
    with pytest.raises(ValueError, match="SendGrid public key"):
        load_sendgrid_public_key(key)


@FUZZ
@given(body=st.binary(max_size=300), signature=st.text(max_size=100),
       timestamp=st.text(max_size=14))
def test_sendgrid_any_bytes_and_headers(body, signature, timestamp):
    try:
        parse_sendgrid(body, signature, timestamp, SENDGRID_PUBLIC)
    except (ProviderAuthError, ValueError):
        pass


@FUZZ
@given(events=JSON)
def test_sendgrid_any_signed_json_shape(events):
    try:
        assert isinstance(parse_sendgrid(*sendgrid(events), SENDGRID_PUBLIC), list)
    except ValueError:
        pass


# Without cryptography -----------------------------------------------------------------

def test_the_module_imports_and_hmac_providers_work_without_cryptography():
    script = f"""
import sys
sys.modules["cryptography"] = None     # as if it were not installed
import campaignapi, json
call = {json.dumps(mailgun(MAILGUN_FAILED))!r}
print(campaignapi._parse_mailgun_callback(call.encode(), {MAILGUN_KEY!r})[0]["type"])
try:
    campaignapi._parse_sendgrid_callback(b"[]", "c2ln", "1", "a2V5")
except RuntimeError as error:
    print(error)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "hard", "Verifying SES and SendGrid callbacks needs the cryptography package:"
                " pip install 'campaignapi[providers]'."]


# Signed calls whose content is anything shaped nearly like the real thing ---------------

def nearly(**fields):
    """Objects with some of ``fields`` (each its own strategy or any JSON)."""
    return st.fixed_dictionaries({}, optional={name: strategy | JSON
                                               for name, strategy in fields.items()})


ADDRESS = st.sampled_from(["ann@example.com", "bob@example.org"]) | st.text(max_size=8)
RECIPIENTS = st.lists(nearly(emailAddress=ADDRESS, diagnosticCode=st.text()), max_size=3)
SES_NEARLY = nearly(
    notificationType=st.sampled_from(["Bounce", "Complaint", "Delivery"]),
    bounce=nearly(bounceType=st.sampled_from(["Permanent", "Transient", "Undetermined"]),
                  bouncedRecipients=RECIPIENTS),
    complaint=nearly(complainedRecipients=RECIPIENTS, complaintFeedbackType=st.text()),
    mail=nearly(messageId=st.text()))


@FUZZ
@given(notification=SES_NEARLY)
def test_sns_signed_notification_of_any_shape(sns, notification):
    try:
        events = sns.read(sns.message(notification))
    except ValueError:
        return
    assert all(e["type"] in ("hard", "soft", "complaint") for e in events)


@FUZZ
@given(event_data=nearly(event=st.sampled_from(["failed", "complained", "delivered"]),
                         severity=st.sampled_from(["permanent", "temporary"]),
                         recipient=ADDRESS,
                         message=nearly(headers=nearly(**{"message-id": st.text()})),
                         **{"delivery-status": nearly(description=st.text())}))
def test_mailgun_signed_event_of_any_shape(event_data):
    try:
        events = mailgun_events(mailgun(event_data))
    except ValueError:
        return
    assert all(e["type"] in ("hard", "soft", "complaint") for e in events)


@FUZZ
@given(record=nearly(RecordType=st.sampled_from(["Bounce", "SpamComplaint", "Delivery"]),
                     Type=st.sampled_from(["HardBounce", "SoftBounce", "SpamComplaint"]),
                     Email=ADDRESS, MessageID=st.text(), Description=st.text()))
def test_postmark_record_of_any_shape(record):
    try:
        events = postmark_events(record)
    except ValueError:
        return
    assert all(e["type"] in ("hard", "soft", "complaint") for e in events)


@FUZZ
@given(events=st.lists(nearly(event=st.sampled_from(["bounce", "dropped", "spamreport"]),
                              type=st.sampled_from(["bounce", "blocked"]),
                              reason=st.sampled_from(["Bounced Address", "Spam Reporting Address"]),
                              email=ADDRESS), max_size=4))
def test_sendgrid_signed_events_of_any_shape(events):
    try:
        found = parse_sendgrid(*sendgrid(events), SENDGRID_PUBLIC)
    except ValueError:
        return
    assert all(e["type"] in ("hard", "soft", "complaint") for e in found)
