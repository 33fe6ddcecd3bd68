"""A big upload is decoded a piece at a time (other threads get the GIL
between pieces); the pieces must accept and refuse exactly what the
one-call decoders do."""

import base64
import binascii
import os
import sys

import pytest

import campaignapi
from helpers import database

# internal: the decoders' piece size: the cases sit on its boundaries
PIECE = campaignapi._PIECE


def _outcome(decode, data):
    try:
        return decode(data)
    except (binascii.Error, ValueError) as error:
        return type(error)


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, PIECE // 4 * 3, PIECE // 4 * 3 + 1,
                                  3 * PIECE + 7])
def test_base64_pieces_decode_like_b64decode(size):
    text = base64.b64encode(os.urandom(size)).decode("ascii")
    step = PIECE // 4 * 4
    variants = [text, text + "!", text[:-1], "====" + text, text[:4] + "=" + text[4:],
                text + "AAAA", text.rstrip("=") + "=A==",
                # padding that ends exactly one piece, data after it
                "A" * (step - 2) + "==" + text[:8]]
    for data in variants:
        expected = _outcome(lambda d: base64.b64decode(d, validate=True), data)
        # internal: the piece-wise decoder against the one-call one
        assert _outcome(campaignapi._b64_pieces, data) == expected, (size, data[:12], data[-12:])


@pytest.mark.parametrize("body", [
    b"", b'{"a": 1}', "\ufeff{\"\u00e9\": \"\u00fc\"}".encode("utf-8"),
    # a two-byte character split across the pieces' boundary
    b"a" * (PIECE - 1) + "\u00e9".encode("utf-8") + b"b" * PIECE,
    b"\xff", b"a" * (PIECE - 1) + b"\xc3", b"a" * PIECE + b"\xed\xa0\x80"])
def test_body_text_decodes_like_utf8_sig(body):
    def one_call(data):
        return data.decode("utf-8-sig")
    # internal: the piece-wise decoder against the one-call one
    assert _outcome(campaignapi._body_text, body) == _outcome(one_call, body)


def test_a_big_base64_upload_imports_every_row(api, db):
    """Through the app: a base64 upload over several pieces, every row kept."""
    ds = api.put("/datasource/0", name="big")["id"]
    rows = 60_000     # about 1.5 MB of base64: more than one piece
    csv = "email,n\n" + "".join(f"user{i}@example.com,{i}\n" for i in range(rows))
    upload = base64.b64encode(csv.encode()).decode("ascii")
    assert len(upload) > PIECE
    made = api.put(f"/datasource/{ds}/import/0", name="big", originalfile="big.csv",
                   __uploadtype__="base64", __uploaddata__=upload)["id"]
    record = api.get(f"/datasource/{ds}/import/{made}")["import"]
    assert (record["status"], record["inserted"], record["skipped"]) == ("finished", str(rows), "0")
    with database(db) as conn:
        assert conn.execute("SELECT count(*), count(DISTINCT email) FROM recipient "
                            "WHERE datasource = ?", (int(ds),)).fetchone()[:] == (rows, rows)
        assert conn.execute("SELECT 1 FROM recipient WHERE email = ?",
                            (f"user{rows - 1}@example.com",)).fetchone()


def test_an_import_takes_short_turns_at_the_gil_and_gives_them_back(api, monkeypatch):
    """While an import runs (and only then) the switch interval is short;
    the process's own comes back after a success and after a refusal."""
    ds = api.put("/datasource/0", name="turns", fields=[{"name": "age", "type": "integer"}])["id"]
    # internal: reads the switch interval while an import runs, from inside it
    seen, finish = [], campaignapi._Importer.finish

    def watching(self, *args):
        seen.append(sys.getswitchinterval())
        return finish(self, *args)

    # internal: watching() runs as the import finishes, still inside its short turns
    monkeypatch.setattr(campaignapi._Importer, "finish", watching)
    before = sys.getswitchinterval()
    # internal: the switch interval an import sets
    assert before > campaignapi._IMPORT_SWITCH_INTERVAL
    api.put(f"/datasource/{ds}/import/0", name="x", originalfile="x.csv", __uploadtype__="csv",
            __uploaddata__="email,age\na@example.com,1\nb@example.com,2\n")
    # internal: the switch interval an import sets
    assert seen and set(seen) == {campaignapi._IMPORT_SWITCH_INTERVAL}
    assert sys.getswitchinterval() == before
    api.put(f"/datasource/{ds}/import/0", status=422, name="x", originalfile="x.csv",
            __uploadtype__="base64", __uploaddata__="not base64 at all!")
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("offset", [0, PIECE - 6, PIECE - 3, PIECE - 1, PIECE, 2 * PIECE + 1])
@pytest.mark.parametrize("escape", [b"\\ud800", b"\\uDFFF", b"\\u00e9"])
def test_surrogate_escapes_are_found_across_pieces(offset, escape):
    body = b'{"a": "' + b"x" * offset + escape + b'"}' + b" " * 10
    # internal: the piece-wise search against the one-call one
    piecewise, one_call = campaignapi._has_surrogate_escape, campaignapi._SURROGATE_ESCAPE
    assert piecewise(body) == (one_call.search(body) is not None) == (escape != b"\\u00e9")
