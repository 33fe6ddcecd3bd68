"""What each public link's token carries, read from real emails with the
module's own readers, is what README's table "What the links carry" says."""

import base64
import datetime
import email
import email.policy
import os
import re
import urllib.parse

import pytest
import webtest

import campaignapi
from conftest import Api
from helpers import database, import_csv, make_signup_list

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "a secret of the test"


def readme_table():
    """``{link: [names it carries, in order]}`` from README's table."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("### What the links carry", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| link ")]
    return {cells[0].strip(): re.findall(r"`(\w+)`", cells[-1]) for cells in rows}


def token_of(text, route):
    return re.search(rf"https://lists\.example\.com/v1/{route}/([A-Za-z0-9_.-]+)", text)[1]


def one(db, sql, *args):
    with database(db) as conn:
        return conn.execute(sql, args).fetchone()


@pytest.fixture
def world(db, smtp_sink):
    """A sign-up confirmed, a tracked campaign sent to it and tested, an export: every
    public link, as the emails and records carry them."""
    client = webtest.TestApp(campaignapi.create_app(
        db, public_url="https://lists.example.com", secret=SECRET))
    api = Api(client, {"Authorization": "Bearer " + campaignapi.create_key(db, "o@example.com")})
    welcome = api.put("/message/0", name="w", subject="Welcome",
                      text="Hello. Leave: {{unsubscribe_url}}")["id"]
    ds = make_signup_list(api, welcomemessage=int(welcome))
    client.post_json(f"/v1/subscribe/{ds}", {"email": "ann@example.org"})
    confirm = token_of(one(db, "SELECT body FROM outbox WHERE kind = 'signup'")[0], "confirm")
    client.post(f"/v1/confirm/{confirm}")
    welcome_mail = one(db, "SELECT body FROM outbox WHERE subject = 'Welcome'")[0]
    import_csv(api, ds, "email\nbob@example.org\n")

    profile = api.put("/accountprofile/0", name="Shop", fromaddress="news@shop.example")["id"]
    message = api.put("/message/0", name="m", subject="Sale", html=(
        '<p><a href="https://shop.example/sale">Sale</a></p>'
        '<p><a href="{{unsubscribe_url}}">unsubscribe</a></p>'))["id"]
    segment = api.put("/segment/0", name="all", datasources=[ds])["id"]
    campaign = int(api.put("/campaign/0", name="C", accountprofile=int(profile),
                           tracking=1)["id"])
    api.put(f"/campaign/{campaign}/message/0", segment=int(segment), message=int(message))
    api.put(f"/campaign/{campaign}/send/0", test=["tester@example.net"])
    api.put(f"/campaign/{campaign}/send/0", timestamp=0)
    campaignapi.process_due(db)
    campaignapi.deliver(db, smtp_sink.address, secret=SECRET, bounce_domain="bounce.example")
    export = api.get(f"/datasource/{ds}/export/0")["export"]
    # Ann also gets the confirmation and the welcome email, in any order with
    # the campaign's: pick the campaign's ("Sale") and the test's emails.
    sent = [(sender, rcpts[0], email.message_from_bytes(
        raw.replace(b"\r\n", b"\n"), policy=email.policy.default))
            for sender, rcpts, raw in smtp_sink.messages]
    sent = [(sender, to, parsed) for sender, to, parsed in sent
            if parsed["Subject"] in ("Sale", "[Test] Sale")]
    return {"db": db, "ds": ds, "campaign": campaign, "confirm": confirm,
            "welcome": welcome_mail, "mail": {to: parsed for _, to, parsed in sent},
            "envelope": {to: sender for sender, to, _ in sent},
            "export": export, "account": one(db, "SELECT owner FROM datasource")[0],
            "report": api.get(f"/campaign/{campaign}/archive/{campaign}")["archive"]["reporturl"]}


def test_each_token_carries_what_the_readme_says(world):
    db, mail = world["db"], world["mail"]
    ann = one(db, "SELECT id FROM recipient WHERE email = 'ann@example.org'")[0]
    outbox = one(db, "SELECT id FROM outbox WHERE kind = 'campaign' AND to_addr = ?",
                 "ann@example.org")[0]
    campaign_mail = mail["ann@example.org"]
    html = campaign_mail.get_body(("html",)).get_content()
    unsubscribe = campaign_mail["List-Unsubscribe"].strip("<>").rsplit("/", 1)[1]
    tested = token_of(mail["tester@example.net"].get_body(("html",)).get_content(),
                      "unsubscribe")
    expires = (datetime.datetime.now(datetime.timezone.utc).date()
               - datetime.date(1970, 1, 1)).days + 7
    read = campaignapi.read_token

    def first_release(token):
        account, address, campaign = campaignapi.read_unsubscribe_token(SECRET, token)
        return {"account": account, "campaign": campaign, "address": address}

    carried = {
        "unsubscribe, campaign email": dict(zip(
            ("campaign", "recipient"), read(SECRET, "unsubscribe", unsubscribe))),
        "confirm": dict(zip(("recipient", "expires"),
                            read(SECRET, "confirm", world["confirm"]))),
        "open": dict(zip(("outbox",), read(SECRET, "open", token_of(html, "open")))),
        "click": dict(zip(("outbox", "link"), read(SECRET, "click", token_of(html, "click")))),
        "VERP": {"outbox": campaignapi.read_verp(SECRET, world["envelope"]["ann@example.org"])},
        "Message-ID": {"outbox": campaignapi.read_message_id(SECRET,
                                                             campaign_mail["Message-ID"])},
        "download": {},
        "report": dict(zip(("campaign", "batch", "expires"), read(
            SECRET, "report", world["report"].rsplit("/", 1)[1]))),
    }
    expected = {
        "unsubscribe, campaign email": {"campaign": world["campaign"], "recipient": ann},
        "confirm": {"recipient": ann, "expires": expires},
        "open": {"outbox": outbox}, "click": {"outbox": outbox, "link": 0},
        "VERP": {"outbox": outbox}, "Message-ID": {"outbox": outbox}, "download": {},
        "report": {"campaign": world["campaign"], "batch": 0, "expires": expires + 23},
    }
    # The first release's form, in a test send and in a sign-up's welcome email.
    assert first_release(tested) == {"account": world["account"], "campaign": world["campaign"],
                                     "address": "tester@example.net"}
    assert first_release(token_of(world["welcome"], "unsubscribe")) == {
        "account": world["account"], "campaign": None, "address": "ann@example.org"}
    carried["unsubscribe, other email"] = first_release(tested)
    expected["unsubscribe, other email"] = {"account": world["account"],
                                            "campaign": world["campaign"],
                                            "address": "tester@example.net"}
    assert carried == expected
    # README names the same ids in the same order, and no other link.
    assert readme_table() == {link: list(ids) for link, ids in carried.items()}


def test_a_download_link_is_random_and_names_nothing(world):
    token = urllib.parse.urlsplit(world["export"]["url"]).path.rsplit("/", 1)[1]
    assert one(world["db"], "SELECT token FROM export")[0] == token
    assert len(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))) == 32
    for purpose in ("open", "click", "unsubscribe", "confirm"):
        assert campaignapi.read_token(SECRET, purpose, token) is None
    assert campaignapi.read_unsubscribe_token(SECRET, token) is None
