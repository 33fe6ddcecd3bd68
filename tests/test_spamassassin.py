"""Deliverability judged by a real filter: a realistic campaign email, built
the way delivery builds it (message in a template, CSS inlined, merge tags
filled, List-Unsubscribe, DKIM), scored by Debian's SpamAssassin offline
(`spamassassin -t -L`, its bundled rules).  The rules that hit are printed.

The "delivered" email takes the product's whole path: a template record with
a <style> block, a message with merge tags and an image link, a campaign sent
through the API, made into a batch, delivered DKIM-signed over SMTP, and
scored as it arrives at the SMTP sink."""

import email
import email.policy
import os
import re
import shutil
import subprocess

import pytest

import campaignapi
from conftest import Api
from helpers import import_csv, keyed_client
from smtp_sink import SmtpSink
from test_delivery import _rsa_key

MAX_SCORE = 1.0
SECRET = "deliverability-test-secret"
BASE = "https://mail.northwind-coffee.example"
SENDER_DOMAIN = "northwind-coffee.example"
TO = "ann.lee@example.org"

TEMPLATE_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">
<title>Northwind Coffee news</title>
<style>
body { margin: 0; background: #f4f1ec; font-family: Georgia, serif; color: #2b2b2b; }
.wrap { max-width: 600px; margin: 0 auto; background: #ffffff; padding: 24px; }
h1 { font-size: 24px; color: #5a3e2b; margin: 0 0 16px; }
h2 { font-size: 19px; color: #5a3e2b; margin: 24px 0 8px; }
p { font-size: 16px; line-height: 1.5; margin: 0 0 12px; }
td { font-size: 15px; padding: 4px 12px 4px 0; }
.footer { font-size: 12px; color: #666666; border-top: 1px solid #dddddd; padding-top: 12px; }
.footer a { color: #5a3e2b; }
@media (max-width: 480px) { .wrap { padding: 12px; } h1 { font-size: 21px; } }
</style></head>
<body><div class="wrap">
<h1>Northwind Coffee</h1>
{{content}}
<div class="footer"><p>You get this email because you signed up for news from Northwind Coffee
at our shop in Bristol. Northwind Coffee Ltd, 12 Harbour Street, Bristol BS1 4QA, United Kingdom.</p>
<p><a href="{{unsubscribe_url}}">Unsubscribe</a> from these emails at any time, with one click.</p>
</div></div></body></html>
"""

TEMPLATE_TEXT = """Northwind Coffee

{{content}}

--
You get this email because you signed up for news from Northwind Coffee at our
shop in Bristol. Northwind Coffee Ltd, 12 Harbour Street, Bristol BS1 4QA,
United Kingdom.
Unsubscribe: {{unsubscribe_url}}
"""

MESSAGE_HTML = """<p>Dear {{first name}},</p>
<p>Our autumn roast from the Huila region of Colombia arrives in the shop this Saturday.
It has notes of red apple, caramel and a little cocoa, and it works well as a filter coffee
or as an espresso with milk.</p>
<p><a href="https://www.northwind-coffee.example/roasts/huila"><img
 src="https://www.northwind-coffee.example/img/huila.jpg" width="560" height="320"
 alt="A bag of the Huila roast next to a cup of filter coffee"></a></p>
<p>Come and taste it at the tasting table between 10:00 and 14:00; Lucia, who roasted it,
will be there to answer questions about the farm and how the beans were processed.</p>
<h2>A brewing tip for the season</h2>
<p>For a filter coffee, use 60 grams of coffee to a litre of water just off the boil, and
grind a little coarser than you would for a summer roast: the sweetness comes out better
with a slightly longer brew. If it tastes sour, grind finer; if it tastes bitter, coarser.</p>
<h2>Opening hours in November</h2>
<table role="presentation">
<tr><td>Monday to Friday</td><td>07:30 to 18:00</td></tr>
<tr><td>Saturday</td><td>08:30 to 17:00</td></tr>
<tr><td>Sunday</td><td>10:00 to 15:00</td></tr>
</table>
<p>Read more about the farm and the people who grow the coffee on
<a href="https://www.northwind-coffee.example/roasts/huila">our website</a>, or reply to
this email if you have a question for us.</p>
<p>See you soon,<br>Maria and the team at Northwind Coffee</p>
"""

MESSAGE_TEXT = """Dear {{first name}},

Our autumn roast from the Huila region of Colombia arrives in the shop this
Saturday. It has notes of red apple, caramel and a little cocoa, and it works
well as a filter coffee or as an espresso with milk.

Come and taste it at the tasting table between 10:00 and 14:00; Lucia, who
roasted it, will be there to answer questions about the farm and how the
beans were processed.

A brewing tip for the season

For a filter coffee, use 60 grams of coffee to a litre of water just off the
boil, and grind a little coarser than you would for a summer roast: the
sweetness comes out better with a slightly longer brew. If it tastes sour,
grind finer; if it tastes bitter, coarser.

Opening hours in November

  Monday to Friday   07:30 to 18:00
  Saturday           08:30 to 17:00
  Sunday             10:00 to 15:00

Read more about the farm and the people who grow the coffee:
https://www.northwind-coffee.example/roasts/huila
or reply to this email if you have a question for us.

See you soon,
Maria and the team at Northwind Coffee
"""


def campaign_email(private_key, *, tracking):
    """The email to Ann as delivery would build it: wrapped, inlined, (with
    tracking) rewritten once, then filled for her and DKIM-signed."""
    # internal: the template wrapping itself
    html_body, text_body = campaignapi._wrap_in_template(TEMPLATE_HTML, TEMPLATE_TEXT,
                                                        MESSAGE_HTML, MESSAGE_TEXT)
    # internal: the CSS inlining step itself
    html_body = campaignapi._inline_css(html_body)
    links = []
    if tracking:
        # internal: the tracking rewrite itself
        html_body, links = campaignapi._track_html(html_body)
    # internal: one email built as delivery builds it
    letter = campaignapi._Letter(f"news@{SENDER_DOMAIN}", "{{first name}}, the autumn roast is here",
                                text_body, html_body, from_name="Northwind Coffee",
                                reply_to=f"hello@{SENDER_DOMAIN}",
                                list_id="<campaign-3.1.campaignapi>")
    # internal: the first-release link, as those emails carry it
    unsubscribe = campaignapi._unsubscribe_url(SECRET, BASE, 1, TO, 3)
    values = {"first name": "Ann", "email": TO, "unsubscribe_url": unsubscribe}
    if tracking:
        # internal: the tokens of one email
        values.update(campaignapi._tracking_values(SECRET, BASE, 4711, len(links)))
    raw = letter.build(TO, values, unsubscribe)
    return campaignapi.dkim_signer(SENDER_DOMAIN, "mail", private_key)(raw), links


def delivered_email(private_key, folder):
    """The same campaign to Ann, sent through the product, as the SMTP sink
    receives it: (raw bytes, [])."""
    db = str(folder / "campaignapi.db")
    client, auth = keyed_client(db, public_url=BASE, secret=SECRET)
    api = Api(client, auth)
    ds = api.put("/datasource/0", name="Coffee news",
                 fields=[{"name": "first name", "type": "text"}])["id"]
    import_csv(api, ds, f"email,first name\n{TO},Ann\n")
    profile = api.put("/accountprofile/0", name="Northwind", fromname="Northwind Coffee",
                      fromaddress=f"news@{SENDER_DOMAIN}", replyto=f"hello@{SENDER_DOMAIN}")["id"]
    template = api.put("/template/0", name="Northwind", html=TEMPLATE_HTML,
                       text=TEMPLATE_TEXT)["id"]
    message = api.put("/message/0", name="Autumn roast",
                      subject="{{first name}}, the autumn roast is here", html=MESSAGE_HTML,
                      text=MESSAGE_TEXT)["id"]
    segment = api.put("/segment/0", name="everyone", datasources=[int(ds)])["id"]
    campaign = api.put("/campaign/0", name="Autumn", accountprofile=int(profile),
                       defaulttemplate=template)["id"]
    api.put(f"/campaign/{campaign}/message/0", segment=int(segment), message=int(message))
    api.put(f"/campaign/{campaign}/send/0", timestamp=0)
    campaignapi.process_due(db)
    sink = SmtpSink().start()
    try:
        counts = campaignapi.deliver(db, sink.address, dkim=(SENDER_DOMAIN, "mail", private_key))
    finally:
        sink.stop()
    assert counts["failed"] == 0, counts
    return next(raw for _, rcpts, raw in sink.messages if rcpts == [TO]), []


def spamassassin():
    path = shutil.which("spamassassin")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("spamassassin is missing; .ci/run installs it")
        pytest.skip("spamassassin is missing (apt-get install spamassassin)")
    return path


def _mbox(messages):
    # mboxrd: one run of the filter for all the emails (its start-up is
    # the slow part); a body line starting with "From " gets a ">".
    out = []
    for raw in messages:
        text = raw.decode("ascii").replace("\r\n", "\n")
        text = re.sub(r"(?m)^(>*From )", r">\1", text)
        out.append(f"From MAILER-DAEMON Thu Jan  1 00:00:00 2026\n{text}\n")
    return "".join(out).encode("ascii")


def _verdict(report):
    """(score, {rule: points}, table) from one email of the filter's output."""
    message = email.message_from_string(report, policy=email.policy.default)
    # The header is folded inside its list of tests: "A,\n\tB".
    status = re.sub(r",\s+", ",", " ".join(str(message["X-Spam-Status"]).split()))
    score = float(re.search(r"score=(-?[\d.]+)", status).group(1))
    table = report[report.index("Content analysis details"):]
    rules = {name: float(points) for points, name in re.findall(
        r"(?m)^\s*(-?\d+\.\d+)\s+([A-Z][A-Z0-9_]+)\s", table)}
    tests = re.search(r"tests=(\S*)", status).group(1)
    assert set(rules) == {name for name in tests.split(",") if name and name != "none"}
    return score, rules, table.strip()


@pytest.fixture(scope="module")
def filtered(tmp_path_factory):
    """Both emails (tracking off and on) and what SpamAssassin says of each."""
    program = spamassassin()
    private, _ = _rsa_key()
    emails = {name: campaign_email(private, tracking=tracking)
              for name, tracking in (("plain", False), ("tracked", True))}
    emails["delivered"] = delivered_email(private, tmp_path_factory.mktemp("delivered"))
    home = tmp_path_factory.mktemp("spamassassin-home")  # its user_prefs go here
    result = subprocess.run(
        [program, "-t", "-L", "--mbox"], input=_mbox(raw for raw, _ in emails.values()),
        capture_output=True, timeout=120, env={**os.environ, "HOME": str(home)})
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    reports = re.split(r"(?m)^From MAILER-DAEMON .*\n", result.stdout.decode("utf-8", "replace"))
    reports = [report for report in reports if report.strip()]
    assert len(reports) == len(emails)
    return {name: (raw, links, _verdict(report))
            for (name, (raw, links)), report in zip(emails.items(), reports)}


def test_the_email_is_what_delivery_makes(filtered):
    raw, _, _ = filtered["plain"]
    assert raw.startswith(b"DKIM-Signature:")
    message = email.message_from_bytes(raw, policy=email.policy.default)
    assert message["Subject"] == "Ann, the autumn roast is here"
    assert message["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    assert message.get_content_type() == "multipart/alternative"
    html_part = message.get_body(("html",)).get_content()
    text_part = message.get_body(("plain",)).get_content()
    assert 'style="font-size: 24px;color: #5a3e2b;margin: 0 0 16px;"' in html_part  # inlined
    assert "@media (max-width: 480px)" in html_part and "Dear Ann," in html_part
    assert f'href="{BASE}/v1/unsubscribe/' in html_part and "{{" not in html_part
    assert "Dear Ann," in text_part and f"Unsubscribe: {BASE}/v1/unsubscribe/" in text_part


def test_the_delivered_email_is_wrapped_inlined_filled_and_signed(filtered):
    raw, _, _ = filtered["delivered"]
    assert raw.startswith(b"DKIM-Signature:")
    message = email.message_from_bytes(raw.replace(b"\r\n", b"\n"), policy=email.policy.default)
    assert message["Subject"] == "Ann, the autumn roast is here"
    assert message["From"] == f"Northwind Coffee <news@{SENDER_DOMAIN}>"
    html_part = message.get_body(("html",)).get_content()
    text_part = message.get_body(("plain",)).get_content()
    assert 'style="font-size: 24px;color: #5a3e2b;margin: 0 0 16px;"' in html_part
    assert "Dear Ann," in html_part and 'src="https://www.northwind-coffee.example/img/' \
        in html_part and f'href="{BASE}/v1/unsubscribe/' in html_part
    assert text_part.startswith("Northwind Coffee\n\nDear Ann,") and "{{" not in text_part


@pytest.mark.parametrize("name", ["plain", "tracked", "delivered"])
def test_spamassassin_scores_the_campaign_email_at_most_one_point(filtered, name):
    raw, links, (score, rules, table) = filtered[name]
    print(f"\nSpamAssassin, {name} email (tracking {'on' if name == 'tracked' else 'off'}): "
          f"score {score}")
    print(table)
    if name == "tracked":
        html_part = email.message_from_bytes(raw, policy=email.policy.default).get_body(
            ("html",)).get_content()
        assert links == ["https://www.northwind-coffee.example/roasts/huila"] * 2
        assert html_part.count(f"{BASE}/v1/click/") == 2 and f"{BASE}/v1/open/" in html_part
    assert score <= MAX_SCORE, f"rules that hit: {rules}"
    assert score == pytest.approx(sum(rules.values()), abs=0.05)
