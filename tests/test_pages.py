"""The pages people see (API.md section 21): the preference centre of the
unsubscribe link, the public archive and its Atom feed, report links,
languages and field labels, the browsable index; every page in a real
browser (Debian's Chromium) at 1280 and 390 px, checked by axe-core."""

import datetime
import email
import email.policy
import os
import re
import string
import urllib.parse

import feedparser
import pytest
import webtest

import campaignapi
from conftest import Api, serving
from helpers import confirm_path, import_csv, make_datasource, make_signup_list, open_url_in, scalar

SECRET = "a secret of the pages"
PUBLIC = "https://lists.example.com"
HERE = os.path.dirname(os.path.abspath(__file__))
ARTIFACTS = os.path.join(HERE, "artifacts", "pages")
AXE = os.path.join(HERE, "axe", "node_modules", "axe-core", "axe.min.js")
HTML = ('<p>Dear {{first}},</p><p>Our <a href="https://shop.example/sale">sale</a> starts '
        'today for {{email}}.</p><p><a href="{{unsubscribe_url}}">Unsubscribe</a></p>')


def parse(raw):
    return email.message_from_bytes(raw.replace(b"\r\n", b"\n"), policy=email.policy.default)


def local(url):
    """The path (and query) of a link the service built from PUBLIC."""
    assert url.startswith(PUBLIC + "/v1/"), url
    return url[len(PUBLIC):]


def today():
    return (datetime.datetime.now(datetime.timezone.utc).date() - datetime.date(1970, 1, 1)).days


def send_campaign(world, name, datasource, subject, public=1):
    """A tracked campaign to every recipient of ``datasource`` (an id or a
    list of them), sent and delivered; its id."""
    api = world["api"]
    message = api.put("/message/0", name=name, subject=subject, html=HTML,
                      text="Dear {{first}}\nLeave: {{unsubscribe_url}}")["id"]
    segment = api.put("/segment/0", name=name, datasources=datasource if isinstance(
        datasource, list) else [datasource])["id"]
    campaign = int(api.put("/campaign/0", name=name, accountprofile=world["profile"],
                           tracking=1, public=public)["id"])
    api.put(f"/campaign/{campaign}/message/0", segment=int(segment), message=int(message))
    api.put(f"/campaign/{campaign}/send/0", timestamp=0)
    campaignapi.process_due(world["db"])
    campaignapi.deliver(world["db"], world["sink"].address, secret=SECRET,
                        public_url=PUBLIC)
    return campaign


@pytest.fixture
def world(db, smtp_sink):
    """Three lists of one account holding Ann and Bob: News (sign-ups, a
    labelled field), Offers (sign-ups, in German) and Private (no
    sign-ups); a public campaign sent twice to News, a private one to News,
    a public one to Private."""
    client = webtest.TestApp(campaignapi.create_app(db, public_url=PUBLIC, secret=SECRET))
    api = Api(client, {"Authorization": "Bearer " + campaignapi.create_key(db, "o@example.com")})
    news = make_signup_list(api, name="News", doubleoptin=0, fields=(
        {"name": "first", "type": "text", "label": "First name"},
        {"name": "vip", "type": "boolean", "label": "Send me VIP offers"}))
    offers = make_signup_list(api, name="Offers", language="de")
    private = make_datasource(api, name="Private", fields=({"name": "first", "type": "text"},))
    for ds in (news, offers, private):
        import_csv(api, ds, "email,first\nann@example.org,Ann\nbob@example.org,Bob\n")
    profile = int(api.put("/accountprofile/0", name="Shop",
                          fromaddress="news@shop.example")["id"])
    world = {"db": db, "client": client, "api": api, "sink": smtp_sink, "profile": profile,
             "news": news, "offers": offers, "private": private}
    world["spring"] = send_campaign(world, "spring", news, "Hi {{first}}: spring news")
    world["spring_mail"] = {to[0]: parse(raw) for _, to, raw in smtp_sink.messages}
    spring_batch = int(api.get(f"/campaign/{world['spring']}/batcharchive/all")
                       ["batcharchive"][0]["id"])
    # The same campaign again later: a second batch, newer.
    api.put(f"/campaign/{world['spring']}/send/0", timestamp=0)
    campaignapi.process_due(db)
    campaignapi.deliver(db, smtp_sink.address, secret=SECRET, public_url=PUBLIC)
    batches = sorted(int(b["id"]) for b in api.get(
        f"/campaign/{world['spring']}/batcharchive/all")["batcharchive"])
    assert batches[0] == spring_batch and len(batches) == 2
    world["batches"] = batches
    world["internal"] = send_campaign(world, "internal", news, "Internal", public=0)
    world["hidden"] = send_campaign(world, "hidden", private, "Hidden")
    return world


def ann_unsubscribe(world):
    """The unsubscribe link of Ann's first spring email (its List-Unsubscribe)."""
    header = str(world["spring_mail"]["ann@example.org"]["List-Unsubscribe"])
    return local(re.search(r"<(https://[^>]+)>", header)[1])


def statuses(world, address):
    return {ds: scalar(world["db"], "SELECT status FROM recipient WHERE datasource = ? AND "
                                    "email = ?", world[ds], address)
            for ds in ("news", "offers", "private")}


# --- The preference centre -----------------------------------------------------------------

def test_the_unsubscribe_page_lists_the_sign_up_lists_that_hold_the_address(world):
    page = world["client"].get(ann_unsubscribe(world))
    assert page.status_int == 200
    items = page.html.select("ul.lists li")
    assert [li.strong.get_text() for li in items] == ["News", "Offers"]   # not Private
    assert [li.select_one(".status").get_text() for li in items] == ["Subscribed"] * 2
    # The one-click form first, unchanged: it posts back to the link itself.
    assert page.forms[0].action in ("", None) and page.forms[0]["List-Unsubscribe"].value == \
        "One-Click"
    assert statuses(world, "ann@example.org") == dict.fromkeys(("news", "offers", "private"),
                                                               "active")


def test_leaving_one_list_changes_only_that_lists_recipient(world):
    client, link = world["client"], ann_unsubscribe(world)
    page = client.get(link)
    leave = next(form for form in page.forms.values()
                 if form.action.endswith(f"/{world['news']}"))
    before_bob = statuses(world, "bob@example.org")
    done = leave.submit()
    assert done.status_int == 200
    assert done.html.select_one('[role="status"]').get_text() == "You left News."
    assert statuses(world, "ann@example.org") == {"news": "unsubscribed",
                                                  "offers": "active", "private": "active"}
    assert statuses(world, "bob@example.org") == before_bob
    assert scalar(world["db"], "SELECT count(*) FROM suppression") == 0
    # The page after the leave: News is left (no button), Offers can still be left, and
    # the one-click form still posts to the link itself.
    items = done.html.select("ul.lists li")
    assert [li.select_one(".status").get_text() for li in items] == ["Left", "Subscribed"]
    assert [bool(li.form) for li in items] == [False, True]
    assert urllib.parse.urljoin(done.request.url, done.forms[0].action).endswith(link)
    # Leaving Offers from that page reaches Offers' recipient, again alone.
    offers = next(form for form in done.forms.values()
                  if form.action.endswith(f"/{world['offers']}"))
    assert urllib.parse.urljoin(done.request.url, offers.action).endswith(
        f"{link}/{world['offers']}")
    client.post(urllib.parse.urljoin(done.request.url, offers.action))
    assert statuses(world, "ann@example.org") == {"news": "unsubscribed",
                                                  "offers": "unsubscribed", "private": "active"}


def test_leaving_a_list_raises_the_unsubscribed_event_with_the_list(world, db):
    events = []
    client = webtest.TestApp(campaignapi.create_app(
        db, public_url=PUBLIC, secret=SECRET, on_event=lambda *event: events.append(event)))
    client.post(ann_unsubscribe(world) + f"/{world['news']}")
    assert [(kind, payload["data"]) for kind, payload in events] == [
        ("recipient.unsubscribed", {"email": "ann@example.org", "campaign": None, "batch": None,
                                    "datasource": str(world["news"])})]
    client.post(ann_unsubscribe(world) + f"/{world['news']}")   # left already: no event
    assert len(events) == 1


def test_the_one_click_post_still_leaves_everything(world):
    world["client"].post(ann_unsubscribe(world), {"List-Unsubscribe": "One-Click"})
    assert statuses(world, "ann@example.org") == {
        "news": "unsubscribed", "offers": "unsubscribed", "private": "unsubscribed"}
    assert scalar(world["db"], "SELECT reason FROM suppression WHERE email = ?",
                  "ann@example.org") == "unsubscribed"


@pytest.mark.parametrize("target", ["private", "other", "word"])
def test_leaving_a_list_that_is_not_offered_changes_nothing(world, target):
    other = make_signup_list(Api(world["client"], {"Authorization": "Bearer " + (
        campaignapi.create_key(world["db"], "stranger@example.net"))}), name="Theirs")
    ds = {"private": world["private"], "other": other, "word": "news"}[target]
    before = statuses(world, "ann@example.org")
    page = world["client"].post(ann_unsubscribe(world) + f"/{ds}", status=404)
    assert page.content_type == "text/html" and "does not work" in page.text
    assert statuses(world, "ann@example.org") == before


def test_a_forged_leave_changes_nothing(world):
    link = ann_unsubscribe(world)
    forged = link[:-2] + ("AA" if not link.endswith("AA") else "BB")
    world["client"].post(f"{forged}/{world['news']}", status=404)
    assert statuses(world, "ann@example.org")["news"] == "active"


# --- The public archive ----------------------------------------------------------------------

def test_the_archive_lists_the_public_sent_batches_newest_first(world):
    page = world["client"].get(f"/v1/archive/{world['news']}")
    assert page.content_type == "text/html"
    links = [a["href"] for a in page.html.select("main ul a")]
    newest, oldest = world["batches"][::-1]
    assert links == [f"{world['news']}/{newest}", f"{world['news']}/{oldest}"]
    assert [a.get_text() for a in page.html.select("main ul a")] == ["Hi : spring news"] * 2
    assert "Internal" not in page.text and "Ann" not in page.text
    assert page.html.select_one("h1").get_text() == "Archive of News"
    # A feed reader given the page finds the feed.
    assert page.html.select_one('head link[rel="alternate"]')["href"] == f"{world['news']}/feed"


def test_an_archived_email_is_shown_as_sent_without_anything_of_a_recipient(world):
    batch = world["batches"][0]
    page = world["client"].get(f"/v1/archive/{world['news']}/{batch}")
    frame = page.html.select_one("iframe")
    assert frame.get("sandbox") in ("", []) and frame["title"] == "The email: Hi : spring news"
    shown = frame["srcdoc"]
    assert "Dear ," in shown and "today for ." in shown
    assert 'href="https://shop.example/sale"' in shown          # as written: not tracked
    for gone in ("Ann", "ann@example.org", "/v1/unsubscribe/", "/v1/click/", "/v1/open/",
                 "Unsubscribe</a>", "href=''", 'href=""'):
        assert gone not in shown, gone
    # What Ann got had all of them (the email as sent, for her).
    ann = world["spring_mail"]["ann@example.org"].get_body(("html",)).get_content()
    assert "Dear Ann" in ann and "/v1/click/" in ann and "/v1/unsubscribe/" in ann


def test_the_feed_reads_back_in_a_feed_reader(world):
    response = world["client"].get(f"/v1/archive/{world['news']}/feed")
    assert response.content_type == "application/atom+xml"
    feed = feedparser.parse(response.body)
    assert not feed.bozo, feed.get("bozo_exception")
    assert feed.version == "atom10"
    assert feed.feed.title == "Archive of News"
    base = f"{PUBLIC}/v1/archive/{world['news']}"
    assert feed.feed.link == base
    assert [link.href for link in feed.feed.links if link.rel == "self"] == [base + "/feed"]
    newest, oldest = world["batches"][::-1]
    assert [entry.id for entry in feed.entries] == [f"{base}/{newest}", f"{base}/{oldest}"]
    for entry in feed.entries:
        assert entry.link == entry.id and entry.title == "Hi : spring news"
        assert entry.updated_parsed is not None
        content = entry.content[0].value
        assert "https://shop.example/sale" in content and "Ann" not in content
        assert "/v1/unsubscribe/" not in content and "/v1/click/" not in content


@pytest.mark.parametrize("where", [
    "private",        # a datasource without sign-ups, even with a public campaign
    "offers",         # sign-ups, but no public campaign mailed it
    "unknown",
])
def test_an_archive_without_sign_ups_or_public_campaigns_is_404(world, where):
    ds = world.get(where, 999999)
    for path in (f"/v1/archive/{ds}", f"/v1/archive/{ds}/feed",
                 f"/v1/archive/{ds}/{world['batches'][0]}"):
        page = world["client"].get(path, status=404)
        assert page.content_type == "text/html", path


def test_a_batch_outside_the_archive_is_404(world, db):
    client, news = world["client"], world["news"]
    internal = int(world["api"].get(f"/campaign/{world['internal']}/batcharchive/all")
                   ["batcharchive"][0]["id"])
    hidden = int(world["api"].get(f"/campaign/{world['hidden']}/batcharchive/all")
                 ["batcharchive"][0]["id"])
    client.get(f"/v1/archive/{news}/{internal}", status=404)    # not public
    client.get(f"/v1/archive/{news}/{hidden}", status=404)      # mailed another list
    client.get(f"/v1/archive/{world['private']}/{hidden}", status=404)   # no sign-ups
    # A campaign made private, or deleted, leaves the archive.
    world["api"].post(f"/campaign/{world['spring']}", public=0)
    client.get(f"/v1/archive/{news}", status=404)
    world["api"].post(f"/campaign/{world['spring']}", public=1)
    client.get(f"/v1/archive/{news}")
    world["api"].delete(f"/campaign/{world['spring']}")
    client.get(f"/v1/archive/{news}/feed", status=404)


def test_archive_ids_follow_the_identifier_rules(world):
    response = world["client"].get("/v1/archive/abc", status=400)
    assert response.json["data"]["error"] == "invalid_identifier"


# --- Report links --------------------------------------------------------------------------

def test_the_archive_records_carry_a_report_link_valid_30_days(world):
    api, spring = world["api"], world["spring"]
    archive = api.get(f"/campaign/{spring}/archive/{spring}")["archive"]
    url = archive["reporturl"]
    assert url.startswith(PUBLIC + "/v1/report/")
    token = url.rsplit("/", 1)[1]
    assert campaignapi.read_token(SECRET, "report", token) == (spring, 0, today() + 30)
    batch = api.get(f"/campaign/{spring}/batcharchive/{world['batches'][1]}")["batcharchive"]
    assert campaignapi.read_token(SECRET, "report", batch["reporturl"].rsplit("/", 1)[1]) == (
        spring, world["batches"][1], today() + 30)
    assert [b["reporturl"] for b in archive["batches"]] == [
        b["reporturl"] for b in api.get(f"/campaign/{spring}/batcharchive/all")["batcharchive"]]


def test_a_report_link_shows_the_statistics_page_without_a_key(world):
    client, spring = world["client"], world["spring"]
    ann = world["spring_mail"]["ann@example.org"].get_body(("html",)).get_content()
    client.get(local(re.search(r'href="(https://[^"]+/v1/click/[^"]+)"', ann)[1]))
    archive = world["api"].get(f"/campaign/{spring}/archive/{spring}")["archive"]
    page = client.get(local(archive["reporturl"]))   # no Authorization header
    assert page.content_type == "text/html"
    assert page.headers["Referrer-Policy"] == "no-referrer"
    assert page.html.select_one('dd[data-figure="sent"]').get_text() == "4"
    assert page.html.select_one('dd[data-figure="clicks"]').get_text() == "1"
    assert page.html.select_one("h1").get_text() == "spring: what happened"
    one = client.get(local(archive["batches"][0]["reporturl"]))
    assert one.html.select_one('dd[data-figure="sent"]').get_text() == "2"
    assert one.html.select_one('dd[data-figure="clicks"]').get_text() == "1"


def test_a_report_link_that_is_altered_or_old_shows_nothing(world):
    client, spring = world["client"], world["spring"]
    url = world["api"].get(f"/campaign/{spring}/archive/{spring}")["archive"]["reporturl"]
    token = url.rsplit("/", 1)[1]
    for bad in (token[:-1] + ("A" if token[-1] != "A" else "B"),
                campaignapi.sign_token(SECRET, "report", spring, 0, today() - 1),
                campaignapi.sign_token(SECRET, "click", spring, 0, today() + 5),
                campaignapi.sign_token(SECRET, "report", spring, 999999, today() + 5),
                campaignapi.sign_token("another secret", "report", spring, 0, today() + 5)):
        page = client.get(f"/v1/report/{bad}", status=404)
        assert "data-figure" not in page.text


# --- Languages and labels ------------------------------------------------------------------

def test_every_language_has_every_string_with_the_same_holes():
    # internal: the one table of the pages' words, checked whole
    table = campaignapi._STRINGS
    holes = string.Formatter()
    for key, texts in table.items():
        assert set(texts) == set(campaignapi.LANGUAGES), key
        english = sorted(name for _, name, _, _ in holes.parse(texts["en"]) if name)
        for language, text in texts.items():
            assert text.strip() and text == text.strip(), (key, language)
            assert sorted(name for _, name, _, _ in holes.parse(text) if name) == english, (
                key, language)
        if key not in ("optional", "archive_feed", "mail_hello", "subscribe_title"):
            assert len(set(texts.values())) > 2, key   # translated, not copied


def test_a_datasource_takes_only_the_known_languages(world):
    api = world["api"]
    assert api.get(f"/datasource/{world['news']}")["datasource"]["language"] == "en"
    assert api.get(f"/datasource/{world['offers']}")["datasource"]["language"] == "de"
    error = api.post(f"/datasource/{world['news']}", status=400, language="it")
    assert error["error"] == "invalid_parameter" and error["field"] == "language"
    assert api.get(f"/datasource/{world['news']}")["datasource"]["language"] == "en"


@pytest.mark.parametrize("language", campaignapi.LANGUAGES)
def test_each_language_reaches_the_form_the_email_and_the_pages(world, language):
    api, client, sink = world["api"], world["client"], world["sink"]
    ds = world["offers"]
    api.post(f"/datasource/{ds}", language=language)
    english = language == "en"
    form = client.get(f"/v1/subscribe/{ds}")
    assert form.html.html["lang"] == language
    assert ("Subscribe" in form.html.select_one("button").get_text()) == english
    refused = client.post(f"/v1/subscribe/{ds}", {"email": "not an address"}, status=400)
    assert refused.html.html["lang"] == language
    assert ("This is not a valid email address." in refused.text) == english
    client.post(f"/v1/subscribe/{ds}", {"email": f"{language}@example.org"})
    campaignapi.deliver(world["db"], sink.address, secret=SECRET)
    mail = parse(sink.messages[-1][2])
    assert mail["To"] == f"{language}@example.org"
    assert str(mail["Subject"]).startswith("Confirm your subscription") == english
    assert ("The link works for 7 days" in mail.get_body(("plain",)).get_content()) == english
    link = confirm_path(mail.get_body(("plain",)).get_content())
    assert link == confirm_path(mail.get_body(("html",)).get_content())
    confirm = client.get(link)
    assert confirm.html.html["lang"] == language
    assert (confirm.html.select_one("button").get_text() == "Yes, subscribe me") == english
    done = client.post(link)
    assert done.html.html["lang"] == language
    assert scalar(world["db"], "SELECT status FROM recipient WHERE email = ?",
                  f"{language}@example.org") == "active"


def test_the_built_in_confirmation_email_in_german(world):
    client, sink = world["client"], world["sink"]
    client.post(f"/v1/subscribe/{world['offers']}", {"email": "eva@example.org"})
    campaignapi.deliver(world["db"], sink.address, secret=SECRET)
    mail = parse(sink.messages[-1][2])
    assert str(mail["Subject"]) == "Bestätigen Sie Ihr Abonnement von Offers"
    text = mail.get_body(("plain",)).get_content()
    assert text.startswith("Hallo,\n\njemand, hoffentlich Sie, möchte die E-Mails von "
                           '"Offers" an diese Adresse erhalten.')
    assert "Der Link gilt 7 Tage." in text
    assert ">Bestätigen Sie Ihr Abonnement</a>" in mail.get_body(("html",)).get_content()


def test_pages_of_an_unknown_list_follow_the_browser(world):
    client = world["client"]
    page = client.get("/v1/unsubscribe/garbled", headers={"Accept-Language": "fr-CH, de;q=0.5"},
                      status=404)
    assert page.html.html["lang"] == "fr"
    assert page.html.select_one("h1").get_text() == "Ce lien ne fonctionne pas"
    page = client.get("/v1/confirm/garbled", headers={"Accept-Language": "it, nl;q=0.8"},
                      status=404)
    assert page.html.html["lang"] == "nl"
    page = client.get("/v1/subscribe/999999", headers={"Accept-Language": "ja"}, status=404)
    assert page.html.html["lang"] == "en"


def test_the_unsubscribe_page_speaks_the_language_of_the_recipients_list(world):
    world["api"].post(f"/datasource/{world['news']}", language="es")
    page = world["client"].get(ann_unsubscribe(world))
    assert page.html.html["lang"] == "es"
    assert page.html.select_one("h1").get_text() == "Darse de baja"
    assert page.html.select_one("button").get_text() == "Darse de baja de todos los correos"


def test_field_labels_show_on_the_form_instead_of_names(world):
    api, client, news = world["api"], world["client"], world["news"]
    record = api.get(f"/datasource/{news}")["datasource"]
    assert {f["name"]: f["label"] for f in record["fields"]} == {
        "email": "", "first": "First name", "vip": "Send me VIP offers"}
    labels = [label.get_text() for label in client.get(f"/v1/subscribe/{news}").html.select(
        "form label")]
    assert labels[:3] == ["Email address", "First name (optional)", "Send me VIP offers"]
    # Change datasource sets the label of a field that exists (its type kept).
    api.post(f"/datasource/{news}", fields=[{"name": "FIRST", "type": "text",
                                             "label": "Your first name"}])
    labels = [label.get_text() for label in client.get(f"/v1/subscribe/{news}").html.select(
        "form label")]
    assert labels[1] == "Your first name (optional)"
    # The address's own label too, else the words of the list's language.
    api.post(f"/datasource/{news}", fields=[{"name": "email", "type": "email",
                                             "label": "Where we write to"}])
    assert client.get(f"/v1/subscribe/{news}").html.select_one("form label").get_text() == \
        "Where we write to"
    error = api.post(f"/datasource/{news}", status=400,
                     fields=[{"name": "first", "type": "text", "label": "two\nlines"}])
    assert error["field"] == "fields"


def test_a_refused_sign_up_names_the_label_in_another_language(world):
    api, client, news = world["api"], world["client"], world["news"]
    api.post(f"/datasource/{news}", language="nl",
             fields=[{"name": "age", "type": "integer", "label": "Leeftijd"}])
    page = client.post(f"/v1/subscribe/{news}", {"email": "jan@example.org", "age": "old"},
                       status=400)
    assert page.html.select_one('[role="alert"]').get_text() == (
        "Controleer Leeftijd: deze waarde kan niet worden gebruikt.")
    assert page.html.select_one('input[name="age"]')["aria-invalid"] == "true"


# --- The API index -------------------------------------------------------------------------

def test_the_index_lists_a_collection_for_every_kind_of_the_route_table(client):
    data = client.get("/v1/").json["data"]
    listed = {re.fullmatch(r"/v1/(\w+)/\{id\}", path)[1]
              for path, operations in campaignapi.openapi_document()["paths"].items()
              if re.fullmatch(r"/v1/(\w+)/\{id\}", path) and "get" in operations
              and "all" in str(operations["get"]["parameters"])}
    assert {"template", "webhook", "datasource", "campaign"} <= listed
    assert set(data["collections"]) == listed
    assert all(href == f"{kind}/all" for kind, href in data["collections"].items())


def test_a_route_added_to_the_table_joins_the_index(db):
    # A kind another part of the API adds (automations, transactional email)
    # appears without the index naming it.
    extra = campaignapi.Route("GET", "/automation/{id:int|all}", "read",
                              lambda call, id: {"automation": []})
    app = campaignapi.create_app(db)
    app.config["campaignapi.service"].routes.append(extra)   # internal: a table made bigger
    data = webtest.TestApp(app).get("/v1/").json["data"]
    assert data["collections"]["automation"] == "automation/all"


def test_the_index_in_a_browser_links_every_collection_and_the_document(client):
    page = client.get("/v1/", headers={"Accept": "text/html"})
    links = {a.get_text(): a["href"] for a in page.html.select("nav a")}
    assert links["The OpenAPI document (openapi.json)"] == "openapi.json"
    data = client.get("/v1/").json["data"]
    assert sorted(href for href in links.values() if href != "openapi.json") == sorted(
        data["collections"].values())
    assert page.html.select_one("h1").get_text() == f"campaignapi {campaignapi.__version__}"


# --- Every page in the browser, at a desktop's and a phone's width --------------------------

WIDTHS = (1280, 390)


def axe_violations(page):
    """axe-core's serious and critical violations on the page."""
    if not os.path.exists(AXE):
        if os.environ.get("CI"):
            pytest.fail(f"{AXE} is missing; .ci/run installs it (npm ci --prefix tests/axe)")
        pytest.skip("axe-core is missing: npm ci --prefix tests/axe")
    page.add_script_tag(path=AXE)
    result = page.evaluate("async () => (await axe.run(document, {resultTypes: "
                           "['violations']})).violations.map(v => ({id: v.id, impact: v.impact, "
                           "nodes: v.nodes.map(n => n.target.join(' '))}))")
    return [v for v in result if v["impact"] in ("serious", "critical")]


def check(page, name):
    """At each width: the page reads without sideways scrolling, is
    saved as tests/artifacts/pages/NAME-WIDTH.png, and axe finds nothing
    serious or critical."""
    os.makedirs(ARTIFACTS, exist_ok=True)
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        assert page.evaluate("document.documentElement.scrollWidth <= innerWidth"), (name, width)
        page.screenshot(path=os.path.join(ARTIFACTS, f"{name}-{width}.png"), full_page=True)
        assert axe_violations(page) == [], (name, width)


@pytest.fixture
def site(world):
    with serving(world["client"].app) as base:
        yield base


def test_every_page_reads_at_desktop_and_phone_widths(world, site, page):
    news, offers = world["news"], world["offers"]
    spring = world["spring"]
    # The sign-up form with its labels, a refusal in German, the page after a sign-up.
    page.goto(f"{site}/v1/subscribe/{news}")
    check(page, "signup-form")
    page.goto(f"{site}/v1/subscribe/{offers}")
    page.get_by_label("E-Mail-Adresse").fill("eva@localhost")   # the browser takes it, we do not
    page.get_by_role("button", name="Abonnieren").click()
    assert page.get_by_role("alert").inner_text() == "Das ist keine gültige E-Mail-Adresse."
    check(page, "signup-refused-de")
    page.get_by_label("E-Mail-Adresse").fill("eva@example.org")
    page.get_by_role("button", name="Abonnieren").click()
    assert page.locator("h1").inner_text() == "Fast geschafft: Sehen Sie in Ihre E-Mails"
    check(page, "signup-pending-de")
    # The confirm page and the page after it.
    campaignapi.deliver(world["db"], world["sink"].address, secret=SECRET)
    link = confirm_path(parse(world["sink"].messages[-1][2]).get_body(("plain",)).get_content())
    page.goto(site + link)
    check(page, "confirm-de")
    page.get_by_role("button", name="Ja, anmelden").click()
    assert page.locator("h1").inner_text() == "Abonnement bestätigt"
    check(page, "confirmed-de")
    # The preference centre, a leave, and leaving everything.
    page.goto(site + ann_unsubscribe(world))
    check(page, "preferences")
    page.get_by_role("button", name="Leave this list").first.click()
    assert page.get_by_role("status").inner_text() == "You left News."
    check(page, "preferences-left")
    page.get_by_role("button", name="Unsubscribe from all emails").click()
    assert page.locator("h1").inner_text() == "Unsubscribed"
    check(page, "unsubscribed")
    page.goto(f"{site}/v1/unsubscribe/garbled")
    check(page, "bad-link")
    # The public archive, one email of it, a 404 of it.
    page.goto(f"{site}/v1/archive/{news}")
    check(page, "archive")
    page.get_by_role("link", name="Hi : spring news").first.click()
    assert page.locator("iframe").count() == 1
    check(page, "archive-email")
    page.goto(f"{site}/v1/archive/{offers}")
    check(page, "archive-none")
    # A report link's statistics page, with opens and clicks in its chart.
    ann = world["spring_mail"]["ann@example.org"].get_body(("html",)).get_content()
    world["client"].get(local(re.search(r'href="(https://[^"]+/v1/click/[^"]+)"', ann)[1]))
    world["client"].get(local(open_url_in(ann)))
    report = world["api"].get(f"/campaign/{spring}/archive/{spring}")["archive"]["reporturl"]
    page.goto(site + local(report))
    assert page.locator("svg g.bucket").count() >= 1
    check(page, "report")
    # The API's own pages: the index and an error envelope.
    page.goto(f"{site}/v1/")
    check(page, "index")
    page.get_by_role("link", name="The OpenAPI document (openapi.json)").click()
    assert page.url == f"{site}/v1/openapi.json"
    page.goto(f"{site}/v1/campaign/all")
    check(page, "envelope-401")


def test_a_long_envelope_wraps_on_a_phone(api, live_server, page):
    page.set_extra_http_headers(api.headers)
    api.put("/message/0", name="x" * 300, subject="y" * 400, text="z")
    page.goto(f"{live_server}/v1/message/all")
    assert page.locator("meta[name=viewport]").count() == 1
    check(page, "envelope-long")


def test_the_checks_catch_what_they_look_for(page):
    # The harness itself: a page as the chart was (a 640 px minimum) scrolls
    # sideways at 390 px, and a form field without a label is a serious violation.
    page.set_viewport_size({"width": 390, "height": 900})
    page.set_content('<!doctype html><html lang="en"><head><title>t</title><meta name="viewport" '
                     'content="width=device-width"></head><body><main><div style="min-width:640px">'
                     'wide</div><input type="text"></main></body></html>')
    assert not page.evaluate("document.documentElement.scrollWidth <= innerWidth")
    assert "label" in {violation["id"] for violation in axe_violations(page)}


def test_a_batch_is_in_the_archive_of_every_list_its_segments_drew_from(world):
    # One email to Ann and Bob, who are on News and Offers: the archive of each shows it.
    api, news, offers = world["api"], world["news"], world["offers"]
    both = send_campaign(world, "both", [news, offers], "For both lists")
    campaignapi.process_due(world["db"])   # the batch is sent
    batch = api.get(f"/campaign/{both}/batcharchive/all")["batcharchive"][0]
    assert batch["status"] == "sent" and batch["sent"] == "2"   # each address once
    for ds in (news, offers):
        page = world["client"].get(f"/v1/archive/{ds}")
        assert "For both lists" in [a.get_text() for a in page.html.select("main ul a")]
        world["client"].get(f"/v1/archive/{ds}/{batch['id']}")
