"""Every kind of signed thing made from the app secret keeps its bytes across
releases: links, envelope senders and Message-IDs already out in sent emails
(and erasure hashes already stored) must keep verifying after an upgrade.

The expected strings below were computed by running the code of commit
5c405d7 (before the one key derivation of the "Signing and tokens" banner
replaced the five derivations spread over the module) with these fixed
secrets and ids, and are hard-coded: they are never to be recomputed from the
code under test.  A change of a key, a label, a truncation or an encoding
breaks them."""

import pytest

import campaignapi
from campaignapi import (message_id_for, read_message_id, read_token, read_unsubscribe_token,
                         read_verp, sign_token, unsubscribe_token, verp_address)

erasure_hash = campaignapi._erasure_hash  # internal: its bytes are pinned (stored hashes match)

TEXT = "pinned secret \u00e9 for test_signing"  # a str secret, as configured or stored
RAW = bytes(range(32))                           # a bytes secret, as embedders may pass
MAX_ID = 2**63 - 1


def _id(value):
    return {TEXT: "text", RAW: "raw"}.get(value) if isinstance(value, (str, bytes)) else None


TOKENS = [  # (secret, purpose, numbers, token of 5c405d7)
    (TEXT, "open", (1,), "AWdctEMXdnwyx4ihZQ"),
    (TEXT, "open", (0,), "AKZN5HNmemY0BpppBQ"),
    (TEXT, "open", (5_000_000,), "wJaxAv4tXNGIILqb0P9e8g"),
    (TEXT, "open", (MAX_ID,), "__________9_7bveP72kG4_md6QY"),
    (TEXT, "click", (987654, 3), "hqQ8AxiZddhK7weKoKu6Ag"),
    (TEXT, "unsubscribe", (12, 345), "DNkCmjImxROzqDMgLIzL"),
    (TEXT, "confirm", (42, 20000), "KqCcAUXfTCZRvfWJWIPhDw"),
    (RAW, "open", (1,), "AbOc6FroUancPCwnTA"),
    (RAW, "open", (0,), "AHzJwSg4Hoantd4Cpg"),
    (RAW, "open", (5_000_000,), "wJaxAr8ss548jdnZYkxlDw"),
    (RAW, "open", (MAX_ID,), "__________9_gt0djGTBD1KV1hwP"),
    (RAW, "click", (987654, 3), "hqQ8A5syJsHL0BoM3MdyFw"),
    (RAW, "unsubscribe", (12, 345), "DNkC2ng9TxC8w1frdYK9"),
    (RAW, "confirm", (42, 20000), "KqCcAbzJszTdzg5Nrs0ROA"),
]

OUTBOX = [  # (secret, outbox id, VERP address at bounce.example.org, Message-ID at example.com)
    (TEXT, 0, "bounces+0-zhda4ugb57sm5veb", "<0.zhda4ugb57sm5veb"),
    (TEXT, 1, "bounces+1-2j5zy25gxc7qmlmj", "<1.2j5zy25gxc7qmlmj"),
    (TEXT, 123456, "bounces+123456-6jafxvha7kxuexk4", "<123456.6jafxvha7kxuexk4"),
    (TEXT, MAX_ID, f"bounces+{MAX_ID}-5idv33z3fdl4qduv", f"<{MAX_ID}.5idv33z3fdl4qduv"),
    (RAW, 0, "bounces+0-effjw3w7bfkigrqg", "<0.effjw3w7bfkigrqg"),
    (RAW, 1, "bounces+1-pxvvfdgwzuguryeo", "<1.pxvvfdgwzuguryeo"),
    (RAW, 123456, "bounces+123456-6qwnd4nfm3llzssi", "<123456.6qwnd4nfm3llzssi"),
    (RAW, MAX_ID, f"bounces+{MAX_ID}-eyzr6ljo2b23g5sq", f"<{MAX_ID}.eyzr6ljo2b23g5sq"),
]

ADDRESS_TOKENS = [  # the unsubscribe tokens of the first release: (account, address, campaign)
    ((7, "ann@example.com", None), "Nzo6YW5uQGV4YW1wbGUuY29t.rfmUl_Y6fGxLx1MEJczdNA"),
    ((7, "ann@example.com", 3), "NzozOmFubkBleGFtcGxlLmNvbQ.RQk3E04APR4GYkuWgUQdew"),
    ((9, "bj\u00f6rn@example.se", 11), "OToxMTpiasO2cm5AZXhhbXBsZS5zZQ.giXcKqONpIjyKl5u8p5WPQ"),
]

ERASURES = [
    (TEXT, "Ann.Smith@Example.COM", "729630d80d2a93790dce2f8eea1ad4a06521bfc28109e10d9fda3b44cb69382f"),
    (TEXT, "j\u00f6rg@example.de", "41452166937b39ea4c51fe118cdd58a42c6dcefae42f7290b336df2ba1f014dd"),
    (RAW, "Ann.Smith@Example.COM", "652a03575198ab537fbec1ccfe0208e835a557f75329f6f41fc955ba5b198e68"),
    (RAW, "j\u00f6rg@example.de", "e76871dd199819e6308dfaed2df343a86c8dab758f87e1bdf2b2793552414fe9"),
]


@pytest.mark.parametrize("secret, purpose, numbers, token", TOKENS, ids=_id)
def test_an_opaque_token_of_the_last_release_reads_and_is_made_again(secret, purpose, numbers,
                                                                      token):
    assert read_token(secret, purpose, token) == numbers
    assert sign_token(secret, purpose, *numbers) == token


@pytest.mark.parametrize("secret, outbox, verp, message_id", OUTBOX, ids=_id)
def test_a_verp_address_and_a_message_id_of_the_last_release_read_and_are_made_again(
        secret, outbox, verp, message_id):
    address, mid = f"{verp}@bounce.example.org", f"{message_id}@example.com>"
    assert read_verp(secret, address) == outbox
    assert read_verp(secret, f"Mailer <{address.upper()}>") == outbox
    assert verp_address(secret, outbox, "bounce.example.org") == address
    assert read_message_id(secret, mid) == outbox
    assert message_id_for(secret, outbox, "example.com") == mid


@pytest.mark.parametrize("subject, token", ADDRESS_TOKENS, ids=_id)
def test_an_unsubscribe_token_of_the_first_release_reads_and_is_made_again(subject, token):
    assert read_unsubscribe_token(TEXT, token) == subject
    assert unsubscribe_token(TEXT, *subject) == token


@pytest.mark.parametrize("secret, address, digest", ERASURES, ids=_id)
def test_an_erased_address_keeps_its_hash(secret, address, digest):
    # Stored hashes of erased addresses must still match them after an upgrade.
    assert erasure_hash(secret, address) == digest
    assert erasure_hash(secret, address.upper()) == digest


def test_a_kind_signed_under_the_secret_itself_is_no_token_purpose():
    # The older kinds (VERP, first-release unsubscribe tokens, erasure hashes)
    # are keyed by the secret itself: as a token purpose, their label would let
    # a token's mac stand for, say, a VERP mac.
    token = sign_token(TEXT, "open", 49)
    for purpose in ("verp", "unsubscribe address", "erasure"):
        with pytest.raises(ValueError):
            sign_token(TEXT, purpose, 49)
        assert read_token(TEXT, purpose, token) is None
