"""Outgoing webhooks: Standard Webhooks signatures, the SSRF guard and the
bounded HTTP client, against real receivers on loopback."""

import base64
import datetime
import json
import socket
import time

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

import campaignapi
from signedhelpers import Receiver, answer, client_context, self_signed

BODY = json.dumps({"type": "recipient.bounced", "timestamp": "2026-11-22T03:00:00Z",
                   "data": {"email": "ann@example.com"}}).encode()


def signed(secret, msg_id="msg_1", body=BODY):
    # internal: our signature, checked against the Standard Webhooks library
    return campaignapi._sign_webhook(secret, msg_id, int(time.time()), body)


# Signatures ---------------------------------------------------------------------

def test_signature_matches_the_standard_webhooks_test_vector():
    # The vector published with the Standard Webhooks specification.
    # internal: our signature, checked against the Standard Webhooks library
    headers = campaignapi._sign_webhook("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                                       "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330,
                                       b'{"test": 2432232314}')
    assert headers == {"webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
                       "webhook-timestamp": "1614265330",
                       "webhook-signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="}


def test_the_reference_library_verifies_and_refuses():
    # internal: the secret's form, as the Standard Webhooks library reads it
    secret = campaignapi._new_webhook_secret()
    assert Webhook(secret).verify(BODY, signed(secret)) == json.loads(BODY)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(BODY + b" ", signed(secret))
    with pytest.raises(WebhookVerificationError):
        # internal: the secret's form, as the Standard Webhooks library reads it
        Webhook(campaignapi._new_webhook_secret()).verify(BODY, signed(secret))
    # internal: our signature, checked against the Standard Webhooks library
    stale = campaignapi._sign_webhook(secret, "msg_1", int(time.time()) - 3600, BODY)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(BODY, stale)


def test_new_secrets_are_random_and_long_enough():
    # internal: the secret's form, as the Standard Webhooks library reads it
    first, second = campaignapi._new_webhook_secret(), campaignapi._new_webhook_secret()
    assert first != second and first.startswith("whsec_")
    assert len(base64.b64decode(first.removeprefix("whsec_"))) >= 24


def test_a_datetime_in_any_zone_signs_the_same_instant():
    # internal: the secret's form, as the Standard Webhooks library reads it
    secret = campaignapi._new_webhook_secret()
    moment = datetime.datetime(2026, 11, 22, 3, 0, tzinfo=datetime.timezone.utc)
    plus_seven = moment.astimezone(datetime.timezone(datetime.timedelta(hours=7)))
    # internal: our signature, checked against the Standard Webhooks library
    assert campaignapi._sign_webhook(secret, "m", plus_seven, BODY) == (
        # internal: our signature, checked against the Standard Webhooks library
        campaignapi._sign_webhook(secret, "m", int(moment.timestamp()), BODY))
    with pytest.raises(ValueError, match="timezone"):
        # internal: our signature, checked against the Standard Webhooks library
        campaignapi._sign_webhook(secret, "m", moment.replace(tzinfo=None), BODY)


@pytest.mark.parametrize("secret", ["whsec_", "whsec_not base64!", ""])
def test_bad_secrets_and_ids_are_refused(secret):
    with pytest.raises(ValueError):
        # internal: our signature, checked against the Standard Webhooks library
        campaignapi._sign_webhook(secret, "m", 1, BODY)
    with pytest.raises(ValueError):
        # internal: the secret's form, as the Standard Webhooks library reads it
        # internal: our signature, checked against the Standard Webhooks library
        campaignapi._sign_webhook(campaignapi._new_webhook_secret(), "a\r\nb", 1, BODY)


# Delivery to real receivers -------------------------------------------------------

def test_a_receiver_using_the_library_verifies_a_delivery():
    # internal: the secret's form, as the Standard Webhooks library reads it
    secret = campaignapi._new_webhook_secret()
    verified = []

    def respond(handler):
        verified.append(Webhook(secret).verify(handler.body, dict(handler.headers)))
        answer(handler, 204)

    with Receiver(respond) as receiver:
        # internal: one signed post, the delivery's own call, to a test receiver
        status, error = campaignapi._post_webhook(receiver.url("/hooks/in?x=1"), signed(secret),
                                                 BODY, allow_private=True)
    assert (status, error) == (204, None)
    assert verified == [json.loads(BODY)]
    request = receiver.requests[0]
    assert request["path"] == "/hooks/in?x=1" and request["body"] == BODY
    assert request["headers"]["Host"] == f"127.0.0.1:{receiver.port}"
    assert request["headers"]["Content-Type"] == "application/json"


def test_a_failing_receiver_then_succeeds_with_the_same_signed_call():
    # internal: the secret's form, as the Standard Webhooks library reads it
    secret, statuses = campaignapi._new_webhook_secret(), [500, 200]

    with Receiver(lambda h: answer(h, statuses.pop(0), b"oops")) as receiver:
        headers = signed(secret, "msg_retry")
        # internal: one signed post, the delivery's own call, to a test receiver
        first = campaignapi._post_webhook(receiver.url(), headers, BODY, allow_private=True)
        # internal: one signed post, the delivery's own call, to a test receiver
        second = campaignapi._post_webhook(receiver.url(), headers, BODY, allow_private=True)
    assert first == (500, "the receiver answered 500")
    assert second == (200, None)
    ids = [r["headers"]["webhook-id"] for r in receiver.requests]
    assert ids == ["msg_retry", "msg_retry"]
    for request in receiver.requests:
        Webhook(secret).verify(request["body"], request["headers"])


def test_a_hanging_receiver_is_given_up_on_time():
    with Receiver(lambda h: receiver.release.wait(10)) as receiver:
        started = time.monotonic()
        # internal: one signed post, the delivery's own call, to a test receiver
        status, error = campaignapi._post_webhook(receiver.url(), {}, BODY, allow_private=True,
                                                 timeout=0.5)
        elapsed = time.monotonic() - started
    assert status is None and error == "no answer within 0.5 seconds"
    assert 0.45 <= elapsed < 1.0


def test_a_receiver_dripping_its_headers_is_bounded_by_the_total_time():
    def drip(handler):
        handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
        while not receiver.release.wait(0.05):
            handler.wfile.write(b"X-Slow: 1\r\n")
            handler.wfile.flush()

    with Receiver(drip) as receiver:
        started = time.monotonic()
        # internal: one signed post, the delivery's own call, to a test receiver
        status, error = campaignapi._post_webhook(receiver.url(), {}, BODY, allow_private=True,
                                                 timeout=0.6)
        elapsed = time.monotonic() - started
    assert (status, error) == (None, "no answer within 0.6 seconds")
    assert elapsed < 1.1


def test_an_endless_answer_body_is_not_read():
    def endless(handler):
        handler.send_response(200)
        handler.end_headers()
        chunk = b"x" * 65536
        while not receiver.release.is_set():
            handler.wfile.write(chunk)

    with Receiver(endless) as receiver:
        started = time.monotonic()
        # internal: one signed post, the delivery's own call, to a test receiver
        result = campaignapi._post_webhook(receiver.url(), {}, BODY, allow_private=True,
                                          timeout=5, max_response=1024)
        elapsed = time.monotonic() - started
    assert result == (200, None) and elapsed < 1.0


def test_endless_headers_stop_at_max_response():
    def endless(handler):
        handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
        while not receiver.release.is_set():
            handler.wfile.write(b"X-Filler: " + b"y" * 1000 + b"\r\n")

    with Receiver(endless) as receiver:
        started = time.monotonic()
        # internal: one signed post, the delivery's own call, to a test receiver
        status, error = campaignapi._post_webhook(receiver.url(), {}, BODY, allow_private=True,
                                                 timeout=5, max_response=4096)
    assert status is None and "longer than 4096 bytes" in error
    assert time.monotonic() - started < 1.0


def test_a_huge_body_is_refused_by_fetch_after_max_bytes(tmp_path):
    key, cert = self_signed("localhost")
    with Receiver(lambda h: answer(h, 200, b"z" * 5_000_000), tls=(key, cert),
                  tmp_path=tmp_path) as receiver:
        url = receiver.url(host="localhost", scheme="https")
        with pytest.raises(ValueError, match="longer than 1000 bytes"):
            # internal: the HTTP client itself, on a local TLS server
            campaignapi._fetch_https(url, allow_private=True, context=client_context(cert),
                                    timeout=5, max_bytes=1000)


def test_redirects_are_not_followed():
    with Receiver(lambda h: answer(h, 200)) as target:
        with Receiver(lambda h: answer(h, 302, headers=[("Location", target.url())])) as hop:
            # internal: one signed post, the delivery's own call, to a test receiver
            status, error = campaignapi._post_webhook(hop.url(), {}, BODY, allow_private=True)
    assert status == 302 and "redirect" in error and "not followed" in error
    assert target.connections == 0 and target.requests == []


def test_https_checks_the_certificate_against_the_host_name(tmp_path):
    key, cert = self_signed("localhost")
    with Receiver(lambda h: answer(h, 200), tls=(key, cert), tmp_path=tmp_path) as receiver:
        # internal: one signed post, the delivery's own call, to a test receiver
        ok = campaignapi._post_webhook(receiver.url(host="localhost", scheme="https"), {}, BODY,
                                      allow_private=True, context=client_context(cert))
        # The same server by its address: the certificate does not name 127.0.0.1.
        # internal: one signed post, the delivery's own call, to a test receiver
        refused = campaignapi._post_webhook(receiver.url(scheme="https"), {}, BODY,
                                           allow_private=True, context=client_context(cert))
        # And a server whose certificate nobody vouched for.
        # internal: one signed post, the delivery's own call, to a test receiver
        untrusted = campaignapi._post_webhook(receiver.url(host="localhost", scheme="https"), {},
                                             BODY, allow_private=True)
    assert ok == (200, None)
    assert "localhost" in receiver.sni
    assert receiver.requests[0]["headers"]["Host"] == f"localhost:{receiver.port}"
    assert refused[0] is None and "certificate" in refused[1]
    assert untrusted[0] is None and "certificate" in untrusted[1]


def test_the_checked_address_is_the_one_connected_to(monkeypatch):
    """DNS rebinding: a name that answers loopback first and something else
    afterwards is looked up once, and the first answer is the one used."""
    real, calls = socket.getaddrinfo, []

    def rebinding(host, port, *args, **kwargs):
        if host != "rebind.test":
            return real(host, port, *args, **kwargs)
        calls.append(host)
        address = "127.0.0.1" if len(calls) == 1 else "10.66.66.66"
        return real(address, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    with Receiver(lambda h: answer(h, 200)) as receiver:
        # internal: one signed post, the delivery's own call, to a test receiver
        result = campaignapi._post_webhook(receiver.url(host="rebind.test"), {}, BODY,
                                          allow_private=True, timeout=2)
    assert result == (200, None) and calls == ["rebind.test"]
    assert receiver.requests[0]["headers"]["Host"] == f"rebind.test:{receiver.port}"


# Refusals: no traffic at all --------------------------------------------------------

REFUSED = [
    ("127.0.0.1", "loopback"), ("[::1]", "loopback"), ("10.0.0.1", "private"),
    ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("100.64.0.1", "private"),
    ("169.254.169.254", "metadata"), ("169.254.1.1", "link-local"), ("[fe80::1]", "link-local"),
    ("[fd00::1]", "unique-local"), ("[::ffff:127.0.0.1]", "loopback"),
    ("[::ffff:169.254.169.254]", "metadata"), ("[2002:7f00:1::]", "loopback"),
    ("[64:ff9b::a00:1]", "private"), ("0.0.0.0", "unspecified"), ("[::]", "unspecified"),
    ("224.0.0.1", "multicast"), ("[ff02::1]", "multicast"), ("240.0.0.1", "reserved"),
    ("127.1", "loopback"), ("2130706433", "loopback"), ("localhost", "loopback"),
]


@pytest.mark.parametrize(("host", "kind"), REFUSED)
def test_private_addresses_are_refused_without_traffic(host, kind):
    with Receiver(lambda h: answer(h, 200)) as receiver:
        url = f"http://{host}:{receiver.port}/hook"
        with pytest.raises(ValueError, match=kind) as refused:
            # internal: the URL rule itself, on addresses no DNS here can give
            campaignapi._check_webhook_url(url)
        assert ("webhook_allow_private" in str(refused.value)) == (kind != "metadata")
        # internal: one signed post, the delivery's own call, to a test receiver
        status, error = campaignapi._post_webhook(url, {}, BODY)
    assert status is None and kind in error
    assert receiver.connections == 0 and receiver.requests == []


def test_metadata_addresses_are_refused_even_when_private_ones_are_allowed():
    for url in ("http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/",
                "http://100.100.100.200/"):
        with pytest.raises(ValueError, match="metadata"):
            # internal: the URL rule itself, on addresses no DNS here can give
            campaignapi._check_webhook_url(url, allow_private=True)


def test_public_addresses_pass_and_private_ones_pass_when_allowed():
    # internal: the URL rule itself, on addresses no DNS here can give
    assert campaignapi._check_webhook_url("https://8.8.8.8/hook") == ["8.8.8.8"]
    # internal: the URL rule itself, on addresses no DNS here can give
    assert campaignapi._check_webhook_url("https://[2606:4700::1111]/") == ["2606:4700::1111"]
    # internal: the URL rule itself, on addresses no DNS here can give
    assert campaignapi._check_webhook_url("http://[::ffff:8.8.8.8]/") == ["::ffff:8.8.8.8"]
    # internal: the URL rule itself, on addresses no DNS here can give
    assert campaignapi._check_webhook_url("http://10.0.0.1/", allow_private=True) == ["10.0.0.1"]


@pytest.mark.parametrize(("url", "says"), [
    ("ftp://example.com/x", "http:// or https://"),
    ("example.com/hook", "http:// or https://"),
    ("http://user:pw@8.8.8.8/", "user name or password"),
    ("http:///hook", "must name a host"),
    ("http://exa mple.com/", "spaces"),
    ("http://8.8.8.8:0/", "port"),
    ("http://8.8.8.8:99999/", "port"),
    ("http://[::1/", "not valid"),
    ("https://" + "a" * 2100 + ".com/", "2048"),
    ("http://nonexistent.invalid/", "cannot be resolved"),
])
def test_malformed_urls_get_a_sentence_to_act_on(url, says):
    with pytest.raises(ValueError, match=says):
        # internal: the URL rule itself, on addresses no DNS here can give
        campaignapi._check_webhook_url(url)
    # internal: one signed post, the delivery's own call, to a test receiver
    assert campaignapi._post_webhook(url, {}, BODY)[0] is None
