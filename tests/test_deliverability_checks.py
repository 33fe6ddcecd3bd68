"""Verify's deliverability checks (API.md section 20): size, links and spam,
and the text body made from the html of a message that has none."""

import email
import email.policy
import re
import time

import campaignapi
from conftest import Api
from helpers import import_csv, keyed_client, make_campaign, make_datasource
from smtp_sink import SmtpSink

HTML_ONLY = ('<h1>Spring &amp; news</h1><p>Hi {{first}}, see <a href="https://shop.example/new">'
             'the new range</a>.</p><ul><li>Tea</li><li>Coffee</li></ul>'
             '<p><a href="{{unsubscribe_url}}">Unsubscribe</a></p>')


def html_only_campaign(api):
    ds = make_datasource(api, fields=[{"name": "first", "type": "text"}])
    import_csv(api, ds, "email,first\nann@example.org,Ann\n")
    ids = make_campaign(api, [ds])
    api.post(f"/message/{ids['message']}", text="", html=HTML_ONLY)
    return ids


def test_a_message_without_text_sends_and_previews_a_text_made_from_its_html(api, db):
    ids = html_only_campaign(api)
    link = api.get(f"/campaign/{ids['campaign']}/message/all")["message"][0]["id"]
    preview = api.get(f"/campaign/{ids['campaign']}/preview/{link}")["preview"]
    assert preview["text"].startswith("Spring & news\n\nHi Ann, see the new range "
                                      "(https://shop.example/new).\n\n- Tea\n- Coffee\n\n"
                                      "Unsubscribe (http")
    assert "/v1/unsubscribe/" in preview["text"] and "{{" not in preview["text"]
    api.put(f"/campaign/{ids['campaign']}/send/0", timestamp=0)
    campaignapi.process_due(db)
    sink = SmtpSink().start()
    try:
        campaignapi.deliver(db, sink.address)
    finally:
        sink.stop()
    [raw] = [raw for _, rcpts, raw in sink.messages if rcpts == ["ann@example.org"]]
    message = email.message_from_bytes(raw.replace(b"\r\n", b"\n"), policy=email.policy.default)
    assert message.get_content_type() == "multipart/alternative"
    text = message.get_body(("plain",)).get_content()
    assert text.rstrip("\n") == preview["text"].rstrip("\n")


def walkthrough_campaign(api, tracking="1"):
    """The README walk-through's campaign (its sender profile, list, message
    and segment), with a template and tracking on."""
    profile = api.put("/accountprofile/0", name="Shop news", fromname="The Shop",
                      fromaddress="news@example.com")["id"]
    ds = api.put("/datasource/0", name="Customers",
                 fields=[{"name": "first name", "type": "text"}])["id"]
    import_csv(api, ds, "email,first name\nann@example.org,Ann\nbob@example.org,Bob\n")
    message = api.put("/message/0", name="Spring", subject="Hello {{first name}}",
                      text="Hi {{first name}}, spring is here.\nUnsubscribe: {{unsubscribe_url}}",
                      html='<p>Hi {{first name}}, spring is here.</p>'
                           '<a href="{{unsubscribe_url}}">Unsubscribe</a>')["id"]
    segment = api.put("/segment/0", name="Named", datasources=[int(ds)],
                      conditions=[{"field": "first name", "op": "notempty"}])["id"]
    template = api.put("/template/0", name="Shop", html=WALKTHROUGH_TEMPLATE,
                       text="The Shop\n\n{{content}}\n\n--\nThe Shop, 1 Market Street")["id"]
    campaign = api.put("/campaign/0", name="Spring sale", accountprofile=int(profile),
                       tracking=tracking, defaulttemplate=template)["id"]
    api.put(f"/campaign/{campaign}/message/0", segment=int(segment), message=int(message))
    return campaign


WALKTHROUGH_TEMPLATE = ('<!doctype html><html><head><meta charset="utf-8"><title>The Shop</title>'
                        '<style>p { font-family: sans-serif; }</style></head><body>'
                        '{{content}}<p>The Shop, 1 Market Street</p></body></html>')


def spam_check(api, campaign):
    checks = {check["check"]: check for check in
              api.get(f"/campaign/{campaign}/verify/0")["verify"]["checks"]}
    return checks["spam"]


def scored(message):
    """The score and rules of verify's spam message of the one message."""
    score = float(re.search(r"scores (-?[\d.]+) \(rules: ([^)]*)\)", message).group(1))
    return score, re.search(r"\(rules: ([^)]*)\)", message).group(1)


def test_the_walkthrough_email_with_a_template_and_tracking_scores_at_most_one(
        api, spamassassin):
    campaign = walkthrough_campaign(api)
    check = spam_check(api, campaign)
    assert check["passed"] == "1", check
    score, rules = scored(check["message"])
    print(f"\nSpamAssassin, the walk-through's tracked email: {score} ({rules})")
    assert score <= 1.0, check["message"]
    assert "HTML_IMAGE_ONLY" not in rules and "IMAGE" not in rules


def test_spam_check_fails_at_the_threshold_and_names_the_rules(db, spamassassin):
    client, auth = keyed_client(db, spam_threshold=0.5)
    api = Api(client, auth)
    campaign = walkthrough_campaign(api)
    assert spam_check(api, campaign)["passed"] == "1"
    # A short email with an image of its own: SpamAssassin's image-only rules hit.
    message = api.get(f"/campaign/{campaign}/message/all")["message"][0]["message"]
    api.post(f"/message/{message}", html='<p><img src="https://shop.example/spring.png" '
             'width="600" height="400" alt="Spring"></p><a href="{{unsubscribe_url}}">x</a>')
    check = spam_check(api, campaign)
    assert check["passed"] == "0" and "at or above 0.5" in check["message"], check
    assert "HTML_IMAGE_ONLY_" in check["message"]
    answer = api.put(f"/campaign/{campaign}/send/0", status=409, timestamp=0)
    assert answer["error"] == "verification_failed"


def test_spam_check_is_skipped_and_says_so_without_spamassassin(db, tmp_path, monkeypatch):
    client, auth = keyed_client(db, spamassassin=str(tmp_path / "missing" / "spamassassin"))
    api = Api(client, auth)
    campaign = walkthrough_campaign(api)
    # A named program that cannot run fails the check, saying why.
    check = spam_check(api, campaign)
    assert check["passed"] == "0" and "could not score" in check["message"], check
    # Nothing on the PATH and no setting: passed, and it says it was skipped.
    monkeypatch.setenv("PATH", str(tmp_path))
    client, auth = keyed_client(db)
    check = spam_check(Api(client, auth), campaign)
    assert check["passed"] == "1" and check["message"].startswith("Skipped: SpamAssassin is not "
                                                                  "installed"), check


def test_links_check_asks_every_link_at_once_and_names_those_that_fail(db, link_server):
    base, server = link_server
    client, auth = keyed_client(db, webhook_allow_private=True)
    api = Api(client, auth)
    ids = html_only_campaign(api)
    paths = ["/ok", "/get-only", "/missing", "/hop/5", "/hop/6", "/slow", "/slow?again",
             "/slow?and-again"]
    api.post(f"/message/{ids['message']}", html="".join(
        f'<p><a href="{base}{path}">link {n}</a></p>' for n, path in enumerate(paths))
        + f'<p>Also at {base}/ok</p><a href="{{{{unsubscribe_url}}}}">Unsubscribe</a>',
        text=f"See {base}/missing\nUnsubscribe: {{{{unsubscribe_url}}}}")
    verify = f"/campaign/{ids['campaign']}/verify/0"
    unasked = {c["check"]: c for c in api.get(verify)["verify"]["checks"]}["links"]
    assert unasked["passed"] == "1" and "links=1" in unasked["message"] and not server.seen
    started = time.monotonic()
    checks = {c["check"]: c for c in api.get(verify, links=1)["verify"]["checks"]}
    took = time.monotonic() - started
    message = checks["links"]["message"]
    assert checks["links"]["passed"] == "0", message
    failing = set(re.findall(rf"{re.escape(base)}(\S+) \(", message))
    assert failing == {"/missing", "/hop/6", "/slow", "/slow?again", "/slow?and-again"}, message
    assert f"{base}/missing (answered 404)" in message and "5 times" in message
    assert "no answer within 5 seconds" in message
    assert took < 3 * 5, took   # three 5-second timeouts, side by side
    assert server.seen.count(("HEAD", "/get-only")) == server.seen.count(("GET", "/get-only")) == 1
    assert ("HEAD", "/ok") in server.seen and ("GET", "/ok") not in server.seen
    assert not any("unsubscribe" in path for _, path in server.seen)
    # Without webhook_allow_private, loopback links are refused as webhooks are, never called.
    server.seen.clear()
    client, auth = keyed_client(db)
    checks = {c["check"]: c for c in Api(client, auth).get(verify, links=1)["verify"]["checks"]}
    assert checks["links"]["passed"] == "0" and not server.seen
    assert "loopback" in checks["links"]["message"], checks["links"]["message"]


def test_links_check_asks_where_tracked_links_lead(db, link_server):
    base, server = link_server
    api = Api(*keyed_client(db, webhook_allow_private=True))
    ids = html_only_campaign(api)
    api.post(f"/campaign/{ids['campaign']}", tracking="1")
    api.post(f"/message/{ids['message']}", html=f'<p><a href="{base}/ok">fine</a> '
             f'<a href="{base}/missing?for={{{{first}}}}">gone</a></p>'
             '<a href="{{unsubscribe_url}}">Unsubscribe</a>',
             text="The spring range is in.\nUnsubscribe: {{unsubscribe_url}}")
    links = {c["check"]: c for c in api.get(f"/campaign/{ids['campaign']}/verify/0",
                                            links=1)["verify"]["checks"]}["links"]
    # The email's links are click links of the service: their targets are asked,
    # with the sample recipient's merge values.
    assert links["passed"] == "0", links
    assert re.findall(r"(http://\S+) \(", links["message"]) == [f"{base}/missing?for=Ann"], links
    assert sorted(path for _, path in server.seen) == ["/missing?for=Ann", "/ok"]

