"""Verify's deliverability checks (API.md section 20): size, links and spam,
and the text body made from the html of a message that has none."""

import email
import email.policy

import campaignapi
from helpers import import_csv, make_campaign, make_datasource
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
