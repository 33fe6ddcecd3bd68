"""The rendering helpers of tracking and templates: signed tokens, the
tracking rewrite, the open GIF, CSS inlining and template wrapping."""

import hmac
import html.parser
import logging
import re
import string
import struct

import pytest
from hypothesis import given, settings, strategies as st

import campaignapi
from helpers import b64, fill, reference_fill
from campaignapi import read_token, sign_token

# The rendering steps are tested one by one, on edge cases no single email shows.
GIF_PIXEL = campaignapi._GIF_PIXEL  # internal: the open image's bytes
check_template = campaignapi._check_template  # internal: the template rule itself
click_target = campaignapi._click_target  # internal: where a click token leads
inline_css = campaignapi._inline_css  # internal: the CSS inlining step itself
track_html = campaignapi._track_html  # internal: the tracking rewrite itself
tracking_values = campaignapi._tracking_values  # internal: the tokens of one email
wrap_in_template = campaignapi._wrap_in_template  # internal: the template wrapping itself

SECRET = "k3y-of-the-test"
B64URL = string.ascii_letters + string.digits + "-_"
PIXEL_SRC = "{{open_url}}"
# The open signal as track_html() writes it in a short html (these tests' sources): a CSS
# background (see test_a_long_html_carries_the_open_signal_as_an_image).
PIXEL = campaignapi._PIXEL_BACKGROUND  # internal: these tests check where the open signal goes


# Tokens ------------------------------------------------------------------------

@pytest.mark.parametrize("purpose, numbers", [
    ("open", (1,)), ("click", (123456, 0)), ("click", (2**63 - 1, 4095)),
    ("unsubscribe", (7, 1_000_000, 31)), ("confirm", (20_500, 127, 128, 16383, 16384)),
    ("open", ()),
])
def test_a_token_reads_back_as_its_numbers(purpose, numbers):
    token = sign_token(SECRET, purpose, *numbers)
    assert read_token(SECRET, purpose, token) == numbers
    assert set(token) <= set(B64URL)


def test_tokens_are_short():
    # An outbox id of a large install and a link index: what a click link carries.
    # 16 and 17 bytes: varints of 4 and 1 bytes and 12 of signature.
    assert len(sign_token(SECRET, "open", 5_000_000)) == 22
    assert len(sign_token(SECRET, "click", 5_000_000, 12)) == 23
    assert len(sign_token(SECRET, "click", 2**40, 12)) <= 26


def test_every_single_character_change_is_refused():
    token = sign_token(SECRET, "click", 987654, 3)
    for index, char in enumerate(token):
        for other in B64URL + "=.+/ ":
            if other != char:
                assert read_token(SECRET, "click", token[:index] + other + token[index + 1:]) is None
        assert read_token(SECRET, "click", token[:index] + token[index + 1:]) is None
        for extra in "A_=":
            assert read_token(SECRET, "click", token[:index] + extra + token[index:]) is None
    assert read_token(SECRET, "click", token + "A") is None
    assert read_token(SECRET, "click", token + "=") is None
    assert read_token(SECRET, "click", token + "==") is None


def test_a_token_belongs_to_its_purpose_and_secret():
    token = sign_token(SECRET, "click", 42, 1)
    for purpose in ("open", "unsubscribe", "confirm", "Click", ""):
        assert read_token(SECRET, purpose, token) is None
    assert read_token(SECRET + "x", "click", token) is None
    assert read_token(SECRET.encode(), "click", token) == (42, 1)  # bytes or str: one secret


def test_a_token_has_no_second_spelling_of_its_numbers():
    # A varint with a needless zero group, correctly signed, is still refused:
    # one row, one token.
    # internal: a correctly signed forgery needs the key of the purpose
    key = campaignapi._purpose_key(SECRET, "open")

    def forged(payload):
        # internal: the token's MAC length, to forge one
        mac = hmac.digest(key, payload, "sha256")[:campaignapi._TOKEN_MAC_BYTES]
        return b64(payload + mac)

    assert read_token(SECRET, "open", forged(bytes([0x01]))) == (1,)  # the forger works
    assert read_token(SECRET, "open", forged(bytes([0x81, 0x00]))) is None  # 1 in two bytes
    assert read_token(SECRET, "open", forged(bytes([0x81]))) is None  # unterminated


def test_a_token_holds_no_address_and_no_clear_numbers():
    token = sign_token(SECRET, "unsubscribe", 12, 345)
    assert "@" not in token and "12" not in token and "345" not in token
    assert sign_token(SECRET, "open", 1) != sign_token(SECRET, "open", 2)


@pytest.mark.parametrize("numbers", [(-1,), (1.5,), ("3",), (True,), (None,)])
def test_only_non_negative_integers_can_be_signed(numbers):
    with pytest.raises(ValueError, match="non-negative integers"):
        sign_token(SECRET, "open", *numbers)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=60), st.text(alphabet=B64URL + "=", max_size=40),
                 st.binary(max_size=30).map(b64), st.none(), st.integers(),
                 st.binary(max_size=20)))
def test_any_text_reads_as_none_or_numbers_never_an_error(token):
    result = read_token(SECRET, "click", token)
    assert result is None or (isinstance(result, tuple)
                              and all(isinstance(n, int) and n >= 0 for n in result))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["open", "click", "unsubscribe", "confirm"]),
       st.lists(st.integers(min_value=0, max_value=2**64), max_size=5))
def test_any_numbers_round_trip(purpose, numbers):
    assert read_token(SECRET, purpose, sign_token(SECRET, purpose, *numbers)) == tuple(numbers)


def test_a_very_long_text_is_refused_unread():
    assert read_token(SECRET, "open", "A" * 100_000) is None


# The open GIF -------------------------------------------------------------------

def test_the_open_image_is_a_transparent_1x1_gif89a():
    assert GIF_PIXEL[:6] == b"GIF89a"
    width, height, flags, _, _ = struct.unpack("<HHBBB", GIF_PIXEL[6:13])
    assert (width, height) == (1, 1)
    assert flags & 0x80  # a global colour table of 2 ** ((flags & 7) + 1) colours
    position = 13 + 3 * 2 ** ((flags & 7) + 1)
    # Graphic control extension: transparency on, transparent index 0.
    assert GIF_PIXEL[position:position + 3] == b"!\xf9\x04"
    assert GIF_PIXEL[position + 3] & 1
    position += 8
    assert GIF_PIXEL[position] == 0x2C  # image descriptor
    left, top, image_width, image_height = struct.unpack("<HHHH", GIF_PIXEL[position + 1:position + 9])
    assert (left, top, image_width, image_height) == (0, 0, 1, 1)
    position += 10
    assert GIF_PIXEL[position] == 2  # LZW minimum code size
    size = GIF_PIXEL[position + 1]
    assert GIF_PIXEL[position + 2 + size:] == b"\x00;"  # block end, trailer


def test_the_browser_decodes_the_open_image_as_1x1(page):
    source = "data:image/gif;base64," + campaignapi.base64.b64encode(GIF_PIXEL).decode()
    page.set_content(f'<img id="pixel" src="{source}">', wait_until="load")
    size = page.evaluate("() => { const i = document.getElementById('pixel');"
                         " return [i.complete, i.naturalWidth, i.naturalHeight]; }")
    assert size == [True, 1, 1]


# The tracking rewrite --------------------------------------------------------------

class _Tags(html.parser.HTMLParser):
    """Start tags as the standard parser reads them: [(tag, attrs)]."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.tags = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, attrs))


def without_pixel(text):
    pixel = PIXEL
    assert text.count(pixel) == 1
    return text.replace(pixel, "", 1)


def test_a_long_html_carries_the_open_signal_as_an_image():
    # internal: SpamAssassin's HTML_IMAGE_ONLY_* rules score an <img> in an html part under
    # _IMAGE_ONLY_LENGTH bytes; past it the open signal is the usual 1x1 image.
    long_source = "<body>" + "<p>Some news of the week.</p>\n" * 120 + "</body>"
    out, _ = track_html(long_source)
    image = campaignapi._PIXEL  # internal: the open image's tag
    assert out == long_source.replace("</body>", image + "</body>")
    out, _ = track_html("<body><p>Short.</p></body>")
    assert out == "<body><p>Short.</p>" + PIXEL + "</body>" and "<img" not in out


def test_links_become_numbered_tags_and_the_rest_stays_byte_for_byte():
    source = ('<html><head><title>Hi</title></head><body>\n'
              '<p>Read <a href="https://example.com/a">this</a> and\n'
              "<A HREF='http://example.org/b?x=1&amp;y=2' class=big>that</A>, or "
              '<a class="c" href=https://example.net/c>this</a>.</p>\n'
              '</body></html>\n')
    out, links = track_html(source)
    assert links == ["https://example.com/a", "http://example.org/b?x=1&y=2",
                     "https://example.net/c"]
    expected = (source.replace('"https://example.com/a"', '"{{click_url_0}}"')
                .replace("'http://example.org/b?x=1&amp;y=2'", '"{{click_url_1}}"')
                .replace("https://example.net/c", '"{{click_url_2}}"'))
    assert without_pixel(out) == expected
    assert out.index(PIXEL) == out.index("</body>") - len(PIXEL)


def test_unsubscribe_mailto_tel_anchors_and_relative_links_stay():
    source = ('<body><a href="{{unsubscribe_url}}">Unsubscribe</a>'
              '<a href="{{ Unsubscribe_URL }}">again</a>'
              '<a href="https://example.com/leave?to={{unsubscribe_url}}">via us</a>'
              '<a href="mailto:me@example.com">mail</a><a href="tel:+15551234">call</a>'
              '<a href="#top">top</a><a href="/relative">rel</a><a href="{{homepage}}">home</a>'
              '<a href="javascript:alert(1)">js</a><a name="x">name</a><a href>empty</a>'
              '<a href="ftp://example.com/f">ftp</a></body>')
    out, links = track_html(source)
    assert links == []
    assert without_pixel(out) == source


def test_links_in_comments_scripts_and_styles_stay():
    source = ('<body><!-- <a href="http://old.example.com">old</a> -->'
              '<script>document.write(\'<a href="http://s.example.com">s</a>\')</script>'
              '<style>a[href="http://css.example.com"]{color:red}</style>'
              '<a href="http://real.example.com">real</a></body>')
    out, links = track_html(source)
    assert links == ["http://real.example.com"]
    assert without_pixel(out) == source.replace('"http://real.example.com"', '"{{click_url_0}}"')


def test_a_merge_tag_in_the_host_leaves_the_link_alone():
    # The host must be written out, or a recipient's own data (a sign-up
    # field) could make our click URL redirect anywhere.
    source = ('<a href="https://{{shop}}/offer">a</a><a href="https://shop.example{{tld}}/">b</a>'
              '<a href="https://example.com/u/{{email}}?n={{first name}}">c</a>')
    out, links = track_html(source)
    assert links == ["https://example.com/u/{{email}}?n={{first name}}"]
    assert out.count("{{click_url_") == 1
    assert click_target(links[0], {"email": "ann+x@example.com", "first name": "Ann Lee"}) == \
        "https://example.com/u/ann+x@example.com?n=Ann%20Lee"


def test_click_targets_are_valid_locations_on_the_written_host():
    url = "https://example.com/p?q={{v}}#f"
    for value in ("//evil.example", "@evil.example", "\r\nSet-Cookie: x=1", "\u00e9t\u00e9 \"<>",
                  "/../../x"):
        target = click_target(url, {"v": value})
        assert target.startswith("https://example.com/p?q=")
        assert not any(char in target for char in " \r\n\"<>") and target.isascii()


def test_the_pixel_goes_at_the_end_without_a_body_and_before_an_unfinished_tag():
    out, links = track_html("<p>No body tag</p>")
    assert out == "<p>No body tag</p>" + PIXEL and links == []
    out, _ = track_html("<p>cut off</p><a href=\"http://x.example")
    assert out == "<p>cut off</p>" + PIXEL + "<a href=\"http://x.example"
    assert track_html("")[0] == PIXEL
    # The last </body> counts; one in a comment does not.
    out, _ = track_html("<body>a<!-- </body> --></body>\n")
    assert out == "<body>a<!-- </body> -->" + PIXEL + "</body>\n"


def test_nested_tables_multiline_tags_and_unicode_keep_their_offsets():
    source = ("<body>\n<table><tr><td>\u00e9t\u00e9 \U0001F600\n<table><tr><td>\n"
              "<a\n  class=\"btn\"\n  HREF = \"https://example.com/\u00e9?a=1&amp;b=2\"\n>go</a>\n"
              "</td></tr></table></td><td><a href='https://example.com/2'>2</a></td></tr></table>\n"
              "</body>")
    out, links = track_html(source)
    assert links == ["https://example.com/\u00e9?a=1&b=2", "https://example.com/2"]
    assert without_pixel(out) == (source.replace('"https://example.com/\u00e9?a=1&amp;b=2"',
                                                 '"{{click_url_0}}"')
                                  .replace("'https://example.com/2'", '"{{click_url_1}}"'))


def test_a_duplicate_href_rewrites_the_first_which_browsers_follow():
    out, links = track_html('<a href="http://one.example" href="http://two.example">x</a>')
    assert links == ["http://one.example"]
    assert out.startswith('<a href="{{click_url_0}}" href="http://two.example">')


def test_per_recipient_only_tokens_are_filled():
    source = ('<body><p>Hi {{name}}</p><a href="https://example.com/?u={{email}}">x</a>'
              '<a href="{{unsubscribe_url}}">leave</a></body>')
    prepared, links = track_html(source)
    values = {"name": "<Ann>", "email": "ann@example.com", "unsubscribe_url": "https://u/1"}
    values.update(tracking_values(SECRET, "https://api.example/", 77, len(links)))
    filled = fill(prepared, values, as_html=True)
    assert filled == reference_fill(prepared, values, as_html=True)
    tags = _Tags(filled).tags
    click = tags[2][1][0][1]
    assert click.startswith("https://api.example/v1/click/")
    assert read_token(SECRET, "click", click.rsplit("/", 1)[1]) == (77, 0)
    style = [attrs for tag, attrs in tags if tag == "div"][0][0][1]
    opened = re.search(r"url\(([^)]+)\)", style).group(1)
    assert read_token(SECRET, "open", opened.rsplit("/", 1)[1]) == (77,)
    assert ("href", "https://u/1") in tags[3][1]
    assert "Hi &lt;Ann&gt;" in filled and "ann@example.com" not in filled


HTMLISH = st.lists(st.sampled_from([
    "<a ", "<A ", "href=", "HREF", "=", '"', "'", "http://x.example/", "https://y.example",
    "mailto:a@b", "{{unsubscribe_url}}", "{{email}}", "{{", "}}", "<!--", "-->", "<script>",
    "</script>", "<style>", "</style>", "<body>", "</body>", "</BODY >", "<table>", "<td>",
    ">", "/>", "<", "</a>", "&amp;", "&", "&#", "<![CDATA[", "]]>", "<!doctype html>", "<?",
    " ", "\n", "\r\n", "\t", "x", "\u00e9", "\U0001F600", "/", "#"]), max_size=40).map("".join)
URLS = st.sampled_from(["http://x.example/", "HTTPS://y.example/p?a=1&amp;b=2", " https://z.example ",
                        "https://{{host}}/", "https://w.example/{{email}}", "{{unsubscribe_url}}",
                        "mailto:a@b.example", "#top", "", "https://q.example/'\"", "http:x"])
ANCHORS = st.builds(
    lambda name, extra, href, quote, url, after: f"<{name}{extra} {href}={quote}{url}{quote}{after}>",
    st.sampled_from(["a", "A"]), st.sampled_from(["", " class=x", ' title="a>b"', " id='q'"]),
    st.sampled_from(["href", "HREF", "Href"]), st.sampled_from(['"', "'", ""]), URLS,
    st.sampled_from(["", " ", "/", " target=_blank", "\n"]))
DOCUMENTS = st.lists(st.one_of(ANCHORS, HTMLISH, ANCHORS.map(lambda a: f"<!-- {a} -->"),
                               ANCHORS.map(lambda a: f"<script>{a}</script>")),
                     max_size=8).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.one_of(DOCUMENTS, HTMLISH, st.text(max_size=80)))
def test_any_htmlish_input_is_tracked_without_error(source):
    out, links = track_html(source)
    assert out.count("{{click_url_") - source.count("{{click_url_") == len(links)
    assert all(link.lower().startswith(("http://", "https://")) for link in links)
    if "http" not in source.lower():
        assert links == [] and without_pixel(out) == source
    # Read by the parser, the result is the source's tags with the tracked
    # hrefs replaced, plus the image (wherever the source ends in a whole
    # construct, so that the image can be a tag).
    expected, number = [], 0
    for tag, attrs in _Tags(source).tags:
        if tag == "a" and any(name == "href" and value and value.strip(" \t\n\r\f")
                              .lower().startswith("http") for name, value in attrs):
            attrs = list(attrs)
            index = next(i for i, (name, _) in enumerate(attrs) if name == "href")
            # internal: the oracle takes the renderer's own rule of which links are tracked
            if campaignapi._trackable(attrs[index][1]):
                attrs[index] = ("href", "{{click_url_%d}}" % number)
                number += 1
        expected.append((tag, attrs))
    got = _Tags(out).tags
    pixel = ("img", [("src", PIXEL_SRC), ("width", "1"), ("height", "1"), ("alt", ""),
                     ("style", "display:block;width:1px;height:1px;border:0;margin:0;padding:0")])
    if pixel in got:
        got.remove(pixel)
        assert got == expected


# CSS inlining ---------------------------------------------------------------------

def test_style_blocks_become_style_attributes_and_media_queries_stay():
    source = ('<!doctype html><html><head><style>p { color: #333 } .btn { padding: 8px }'
              '@media (max-width: 600px) { p { font-size: 18px } }</style>'
              '<link rel="stylesheet" href="https://cdn.invalid/x.css"></head>'
              '<body><p>Hi {{first name}}</p><a class="btn" href="{{unsubscribe_url}}" '
              'title="{{email}}">Unsubscribe</a><p style="margin:0">x</p></body></html>')
    out = inline_css(source)
    assert '<p style="color: #333;">Hi {{first name}}</p>' in out
    assert 'href="{{unsubscribe_url}}"' in out and 'title="{{email}}"' in out
    assert 'style="padding: 8px;"' in out
    assert "@media (max-width: 600px)" in out and "<style>" in out
    assert "color: #333;margin:0" in out or "color: #333;margin: 0" in out
    # The remote stylesheet is kept as written and was not fetched (the host
    # cannot resolve: fetching it would have failed the inlining).
    assert 'href="https://cdn.invalid/x.css"' in out


def test_a_merge_tag_in_a_style_attribute_survives():
    out = inline_css('<html><head><style>td{padding:4px}</style></head><body><table><tr>'
                     '<td style="color:{{colour}}">x</td></tr></table></body></html>')
    assert "{{colour}}" in out and "padding: 4px" in out


def test_a_merge_tag_inside_a_style_block_survives():
    out = inline_css('<html><head><style>p{color:{{brand colour}}} a{color:red}</style></head>'
                     '<body><p>x</p><a href="{{unsubscribe_url}}">u</a></body></html>')
    assert '<p style="color: {{brand colour}};">' in out
    assert '<a href="{{unsubscribe_url}}" style="color: red;">' in out


def test_html_without_style_comes_back_as_it_is():
    for source in ("", None, "<p>Hi {{name}}</p>", "<html><body><p style='x'>a</p></body></html>"):
        assert inline_css(source) is source


def test_inliner_failure_sends_the_html_as_written(caplog, monkeypatch):
    source = '<style>p{color:red}</style><link rel="stylesheet" href="x.css"><p>a</p>'
    # A relative stylesheet with no base URL: css-inline cannot resolve it.
    import css_inline
    with pytest.raises(css_inline.InlineError):
        css_inline.CSSInliner(load_remote_stylesheets=True).inline(source)
    # internal: an inliner that fails on this source, as the one made for email never does
    monkeypatch.setattr(campaignapi, "_css_inliner",
                        lambda module: module.CSSInliner(load_remote_stylesheets=True))
    with caplog.at_level(logging.WARNING, logger="campaignapi"):
        assert inline_css(source) == source
    assert "CSS could not be inlined" in caplog.text


# Templates ------------------------------------------------------------------------

def test_the_message_goes_inside_the_template():
    html_out, text_out = wrap_in_template(
        "<html><body><h1>{{name}}'s news</h1>{{ Content }}<p>{{unsubscribe_url}}</p></body></html>",
        "NEWS\n\n{{content}}\n--\nLeave: {{unsubscribe_url}}",
        "<p>Hello {{first name}} \\1 \\g<0></p>", "Hello {{first name}}")
    assert html_out == ("<html><body><h1>{{name}}'s news</h1><p>Hello {{first name}} \\1 \\g<0>"
                        "</p><p>{{unsubscribe_url}}</p></body></html>")
    assert text_out == "NEWS\n\nHello {{first name}}\n--\nLeave: {{unsubscribe_url}}"


def test_a_body_exists_where_the_message_has_it():
    assert wrap_in_template("<div>{{content}}</div>", "", "<p>x</p>", "plain") == \
        ("<div><p>x</p></div>", "plain")
    assert wrap_in_template("<div>{{content}}</div>", "T {{content}}", "", "plain") == \
        ("", "T plain")
    assert wrap_in_template(None, None, "<p>x</p>", None) == ("<p>x</p>", "")


@pytest.mark.parametrize("html_body, text_body, message", [
    ("<div>no tag</div>", "", "The template's html must hold {{content}} exactly once, where "
                              "the message goes; it does not have it."),
    ("", "{{content}} and {{CONTENT}}", "The template's text must hold {{content}} exactly "
                                         "once, where the message goes; it has it 2 times."),
    ("<p>{{content}}</p>", "{content}", "The template's text must hold {{content}} exactly once, "
                                        "where the message goes; it does not have it."),
])
def test_a_template_needs_content_exactly_once(html_body, text_body, message):
    with pytest.raises(ValueError) as raised:
        check_template(html_body, text_body)
    assert str(raised.value) == message
    with pytest.raises(ValueError):
        wrap_in_template(html_body, text_body, "<p>m</p>", "m")


def test_a_good_template_passes():
    check_template("<p>{{content}}</p>", "{{ content }}")
    check_template("", None)
