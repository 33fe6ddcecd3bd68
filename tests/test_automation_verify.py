"""An automation's verify runs the deliverability checks of campaign verify
(API.md sections 17 and 20) on its send steps' emails as they are sent:
size, spam (the real SpamAssassin) and links (only with links=1, against a
real HTTP server); enabling runs size and spam.  Both engines."""

import re

import pytest

from conftest import Api
from helpers import import_csv, keyed_client, make_datasource

HTML = ("<p>Hi {{first}}, the spring range is in.</p>"
        "<p><a href='https://shop.example/spring'>See it</a></p>"
        "<p><a href='{{unsubscribe_url}}'>Unsubscribe</a></p>")
TEXT = "Hi {{first}}, the spring range is in.\nUnsubscribe: {{unsubscribe_url}}"
# GTUBE: the string every SpamAssassin scores 1000 (its own test of the filter).
GTUBE = "XJS*C4JDBQADN1.NSBN3*2IDNEN*GTUBE-STANDARD-ANTI-UBE-TEST-EMAIL*C.34X"


def series(api, html=HTML, text=TEXT, **params):
    """A two-email series (send, wait 1d, send) of one message to a list of
    one; ``(automation, message)``."""
    ds = make_datasource(api, fields=[{"name": "first", "type": "text"}])
    import_csv(api, ds, "email,first\nann@example.org,Ann\n")
    profile = api.put("/accountprofile/0", name="Shop", fromname="The Shop",
                      fromaddress="news@shop.example")["id"]
    message = int(api.put("/message/0", name="Spring", subject="Spring, {{first}}", html=html,
                          text=text)["id"])
    automation = int(api.put("/automation/0", name="Spring series", datasource=ds,
                             trigger={"type": "subscribed"}, accountprofile=int(profile),
                             steps=[{"send": message}, {"wait": "1d"}, {"send": message}],
                             **params)["id"])
    return automation, message


def checks(api, automation, **params):
    record = api.get(f"/automation/{automation}/verify/0", **params)["verify"]
    return record, {check["check"]: check for check in record["checks"]}


def test_verify_lists_size_links_and_spam_after_the_automation_checks(api):
    automation, _ = series(api, tracking="1")
    record, by_name = checks(api, automation)
    assert [c["check"] for c in record["checks"]][-3:] == ["size", "links", "spam"]
    assert record["passed"] == "1", record
    # The one message of both send steps is one sample, measured as sent.
    assert re.fullmatch(r"Every message's html is under 102 KB as sent \(message \d+ "
                        r"\('Spring'\): \d+\.\d KB\)\.", by_name["size"]["message"])
    assert "links=1" in by_name["links"]["message"]


def test_a_message_too_big_as_sent_fails_size_and_enabling(api):
    automation, message = series(api, tracking="1")
    api.post(f"/message/{message}", html="<p>Long.</p>" * 10000
             + "<a href='{{unsubscribe_url}}'>Unsubscribe</a>")
    record, by_name = checks(api, automation)
    assert record["passed"] == "0" and by_name["size"]["passed"] == "0"
    assert re.search(r"'Spring'\) is 1\d\d KB as sent", by_name["size"]["message"])
    assert "102 KB" in by_name["size"]["message"], by_name["size"]
    error = api.post(f"/automation/{automation}", status=409, enabled="1")
    assert error["error"] == "verification_failed"
    assert "size" in [c["check"] for c in error["checks"] if c["passed"] == "0"]
    assert api.get(f"/automation/{automation}")["automation"]["enabled"] == "0"


def test_size_counts_the_template_the_send_steps_wrap_the_message_in(api):
    automation, _ = series(api)
    assert checks(api, automation)[1]["size"]["passed"] == "1"
    # A small message in a big template: the email as sent is too big.
    template = api.put("/template/0", name="Heavy", html="<div>{{content}}</div>"
                       + "<p>Footer text.</p>" * 7000, text="{{content}}")["id"]
    api.post(f"/automation/{automation}", defaulttemplate=template)
    size = checks(api, automation)[1]["size"]
    assert size["passed"] == "0" and "102 KB" in size["message"], size


def test_a_gtube_message_fails_spam_naming_the_rules_and_enabling_is_refused(api, spamassassin):
    automation, message = series(api)
    spam = checks(api, automation)[1]["spam"]
    assert spam["passed"] == "1" and spam["message"].startswith("SpamAssassin (spamassassin) "
                                                                "scores every message under 5:")
    api.post(f"/message/{message}", text=f"{GTUBE}\nUnsubscribe: {{{{unsubscribe_url}}}}")
    record, by_name = checks(api, automation)
    spam = by_name["spam"]
    assert record["passed"] == "0" and spam["passed"] == "0", spam
    assert "at or above 5" in spam["message"] and "GTUBE" in spam["message"], spam
    assert re.search(r"message \d+ \('Spring'\) scores \d+", spam["message"]), spam
    error = api.post(f"/automation/{automation}", status=409, enabled="1")
    assert error["error"] == "verification_failed"
    assert [c["check"] for c in error["checks"] if c["passed"] == "0"] == ["spam"], error["checks"]
    assert api.get(f"/automation/{automation}")["automation"]["enabled"] == "0"
    # Created enabled: refused the same way, nothing made.
    before = len(api.get("/automation/all")["automation"])
    error = api.put("/automation/0", status=409, name="again",
                    datasource=api.get(f"/automation/{automation}")["automation"]["datasource"],
                    trigger={"type": "api"}, steps=[{"send": message}], enabled="1",
                    accountprofile=api.get(f"/automation/{automation}")["automation"][
                        "accountprofile"])
    assert error["error"] == "verification_failed"
    assert len(api.get("/automation/all")["automation"]) == before


def test_the_spam_threshold_setting_applies_to_automations(db, spamassassin):
    api = Api(*keyed_client(db, spam_threshold=-100))
    automation, _ = series(api)
    spam = checks(api, automation)[1]["spam"]
    assert spam["passed"] == "0" and "at or above -100" in spam["message"], spam


def test_links_are_checked_only_with_links_1_and_not_when_enabling(db, link_server):
    base, server = link_server
    api = Api(*keyed_client(db, webhook_allow_private=True))
    automation, message = series(api, tracking="1")
    api.post(f"/message/{message}", html=f"<p><a href='{base}/ok'>fine</a> "
             f"<a href='{base}/missing'>gone</a></p><a href='{{{{unsubscribe_url}}}}'>x</a>",
             text=f"See {base}/get-only\nUnsubscribe: {{{{unsubscribe_url}}}}")
    record, by_name = checks(api, automation)
    assert by_name["links"]["passed"] == "1" and "links=1" in by_name["links"]["message"]
    assert not server.seen
    record, by_name = checks(api, automation, links=1)
    links = by_name["links"]
    assert record["passed"] == "0" and links["passed"] == "0", links
    # Only the message's own links: its tracking and unsubscribe links are the service's.
    assert re.findall(r"(http://\S+) \(", links["message"]) == [f"{base}/missing"], links
    assert f"{base}/missing (answered 404)" in links["message"]
    assert {path for _, path in server.seen} == {"/ok", "/missing", "/get-only"}
    # Enabling checks size and spam, not links (as a campaign's send).
    server.seen.clear()
    api.post(f"/automation/{automation}", enabled="1")
    assert api.get(f"/automation/{automation}")["automation"]["enabled"] == "1"
    assert not server.seen


def test_links_1_is_a_flag(api):
    automation, _ = series(api)
    error = api.get(f"/automation/{automation}/verify/0", status=400, links="maybe")
    assert error["error"] == "invalid_parameter", error


@pytest.mark.parametrize("links", ["0", "1"])
def test_a_stranger_cannot_verify_an_automation(api, stranger_api, links):
    automation, _ = series(api)
    error = stranger_api.get(f"/automation/{automation}/verify/0", status=404, links=links)
    assert error["error"] == "not_found"
