"""Deliverability (API.md section 20): per-domain rates counted in the
database, halved by a receiver's "slow down" deferral, the warm-up's daily
caps, and GET /v1/deliverability/0.  Delivery goes to a real aiosmtpd server
on loopback that throttles one domain the way Gmail does (421 4.7.28)."""

import collections
import subprocess
import sys
import time

import pytest

import campaignapi
from helpers import assert_error, database, keyed_client, later
from smtp_sink import SmtpSink

GMAIL_421 = ("421 4.7.28 Our system has detected an unusual rate of unsolicited mail "
             "originating from your IP address. To protect our users from spam, mail sent from "
             "your IP address has been temporarily rate limited.")


class ThrottlingSink(SmtpSink):
    """Accepts at most ``limit`` emails a second for addresses of ``domain``;
    past that it answers Gmail's 421 4.7.28.  Other domains: no limit."""

    def __init__(self, domain, limit):
        super().__init__()
        self.domain, self.limit = domain, limit
        self.accepted, self.deferred = collections.Counter(), 0

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if address.endswith("@" + self.domain):
            with self.lock:
                second = int(time.time())
                if self.accepted[second] >= self.limit:
                    self.deferred += 1
                    return GMAIL_421
                self.accepted[second] += 1
        return await super().handle_RCPT(server, session, envelope, address, rcpt_options)


def outbox(db):
    with database(db) as conn:
        return [dict(row) for row in conn.execute("SELECT * FROM outbox ORDER BY id")]


def paces(db):
    with database(db) as conn:
        return {row["domain"]: dict(row) for row in conn.execute("SELECT * FROM domain_pace")}


@pytest.fixture
def throttling_sink():
    sink = ThrottlingSink("slow.test", 3).start()
    yield sink
    sink.stop()


def test_a_throttled_domain_slows_down_alone_and_nothing_is_lost_or_sent_twice(
        db, throttling_sink, seed_campaign):
    sink = throttling_sink
    slow = [f"s{i}@slow.test" for i in range(24)]
    fast = [f"f{i}@fast{j}.test" for j in range(4) for i in range(5)]
    seed_campaign([(address, "N") for address in slow + fast])
    rates = {"*": "8/s"}
    # A far "now" makes every retry due at once; the rates run on the real clock.
    first = campaignapi.deliver(db, sink.address, domain_rates=rates, max_attempts=100,
                                now=later(86400))
    rows = outbox(db)
    # The slow domain did not hold up the others: all of them went in the first run.
    assert all(row["status"] == "sent" for row in rows if row["to_addr"] in fast)
    assert sum(row["status"] == "sent" for row in rows if row["to_addr"] in slow) < len(slow)
    assert first["sent"] >= len(fast) and sink.deferred >= 1
    deadline = time.monotonic() + 60
    while any(row["status"] != "sent" for row in outbox(db)):
        assert time.monotonic() < deadline, outbox(db)
        campaignapi.deliver(db, sink.address, domain_rates=rates, max_attempts=100,
                            now=later(86400))
        time.sleep(0.2)
    # Nothing lost, nothing twice: each address got exactly one email.
    received = collections.Counter(rcpt for _, rcpts, _ in sink.messages for rcpt in rcpts)
    assert received == collections.Counter(slow + fast)
    pace = paces(db)
    assert pace["slow.test"]["rate"] < 8 and pace["slow.test"]["deferred"] == sink.deferred
    assert pace["slow.test"]["sent"] == len(slow)
    for j in range(4):
        assert pace[f"fast{j}.test"]["rate"] == 8 and pace[f"fast{j}.test"]["deferred"] == 0
        assert pace[f"fast{j}.test"]["sent"] == 5
    # The record the operator reads says the same.
    client, auth = keyed_client(db, domain_rates=rates)
    record = client.get("/v1/deliverability/0", headers=auth).json["data"]["deliverability"]
    domains = {item["domain"]: item for item in record["domains"]}
    assert domains["slow.test"]["configured"] == "8/s"
    assert float(domains["slow.test"]["rate"].split("/")[0]) < 8
    assert domains["slow.test"]["deferred_hour"] == str(sink.deferred)
    assert domains["slow.test"]["sent_hour"] == str(len(slow))
    assert domains["fast0.test"] == {"domain": "fast0.test", "rate": "8/s", "configured": "8/s",
                                     "sent_hour": "5", "deferred_hour": "0", "queued": "0"}
    assert record["warmup"] == {"day": None, "cap": None, "sent_today": str(len(slow + fast))}


def test_a_rate_is_shared_by_workers_and_by_the_aliases_of_a_domain(db, smtp_sink, seed_campaign):
    addresses = [f"g{i}@gmail.com" for i in range(4)] + [f"m{i}@googlemail.com" for i in range(4)]
    addresses += [f"o{i}@{domain}" for i, domain in enumerate(
        ("hotmail.com", "outlook.fr", "live.co.uk", "msn.com"))]
    addresses += [f"x{i}@other.example" for i in range(6)]
    seed_campaign([(address, "N") for address in addresses])
    rates = ("googlemail.com=3/h", "hotmail.com=2/h")   # the aliases name gmail.com, outlook.com
    counts = [campaignapi.deliver(db, smtp_sink.address, domain_rates=rates, worker_id=f"w{n}")
              for n in range(2)]   # a second worker finds the hour's allowance spent
    assert sum(count["sent"] for count in counts) == 3 + 2 + 6
    rows = outbox(db)
    sent = [row["to_addr"] for row in rows if row["status"] == "sent"]
    assert sum(address.endswith(("gmail.com", "googlemail.com")) for address in sent) == 3
    # (googlemail.com does not end with "gmail.com": the outlook.com aliases by name.)
    assert sum(address.endswith(("@hotmail.com", "@outlook.fr", "@live.co.uk", "@msn.com"))
               for address in sent) == 2
    waiting = [row for row in rows if row["status"] == "queued"]
    assert len(waiting) == 8 - 3 + 4 - 2
    hour_end = later(3600)[:14] + "00:00"
    assert all(row["next_try"] == hour_end and row["attempts"] == 0 for row in waiting)
    client, auth = keyed_client(db, domain_rates=rates)
    record = client.get("/v1/deliverability/0", headers=auth).json["data"]["deliverability"]
    domains = {item["domain"]: item for item in record["domains"]}
    assert (domains["gmail.com"]["configured"], domains["gmail.com"]["queued"]) == ("3/h", "5")
    assert (domains["outlook.com"]["rate"], domains["outlook.com"]["queued"]) == ("2/h", "2")
    assert (domains["other.example"]["configured"], domains["other.example"]["sent_hour"]) == (
        None, "6")


def test_a_domain_rate_admits_the_highest_priority_then_the_oldest_row_first(
        db, smtp_sink, seed_campaign):
    """A claim's rows come in the order they lie in the table among equals
    (PostgreSQL: an updated row lies last, a reused table anywhere): the
    room of a domain's window goes to the highest priority, then the oldest."""
    ids = seed_campaign([(f"g{i}@gmail.com", "N") for i in range(3)])["outbox"]
    with database(db) as conn, campaignapi.transaction(conn):
        account = conn.execute("SELECT id FROM account").fetchone()[0]
        urgent = campaignapi.enqueue(conn, account, "notification", "t@googlemail.com",
                                     subject="Your code", body="123456", priority=1)
        # The oldest row moves to the end of the table (and of its index's
        # equals: an indexed column changes, and back); nothing else changes.
        due = conn.execute("SELECT next_try FROM outbox WHERE id = ?", (ids[0],)).fetchone()[0]
        for next_try in (later(-60), due):
            conn.execute("UPDATE outbox SET next_try = ? WHERE id = ?", (next_try, ids[0]))
    counts = campaignapi.deliver(db, smtp_sink.address, domain_rates=["gmail.com=2/h"])
    assert counts["sent"] == 2
    assert {row["id"] for row in outbox(db) if row["status"] == "sent"} == {urgent, ids[0]}
    assert [rcpts for _, rcpts, _ in smtp_sink.messages] == [["t@googlemail.com"],
                                                             ["g0@gmail.com"]]


def test_warmup_holds_campaign_emails_past_the_day_cap_until_the_next_utc_day(
        db, smtp_sink, seed_campaign):
    seed_campaign([(f"r{i}@example.org", "N") for i in range(5)])
    with database(db) as conn, campaignapi.transaction(conn):
        account = conn.execute("SELECT id FROM account").fetchone()[0]
        campaignapi.enqueue_email(conn, account, "owner@example.com", "Import done", "Done.")
    today = later()[:10]
    counts = campaignapi.deliver(db, smtp_sink.address, warmup="3,10", warmup_start=today)
    assert counts["sent"] == 3 + 1   # the notification is not counted nor held
    waiting = [row for row in outbox(db) if row["status"] == "queued"]
    assert len(waiting) == 2 and all(row["kind"] == "campaign" for row in waiting)
    assert all(row["next_try"] == later(86400)[:10] + " 00:00:00" for row in waiting)
    client, auth = keyed_client(db, warmup="3,10", warmup_start=today)
    record = client.get("/v1/deliverability/0", headers=auth).json["data"]["deliverability"]
    assert record["warmup"] == {"day": "1", "cap": "3", "sent_today": "3"}
    # Day two of the list (the start a day earlier): its cap is 10.
    yesterday = (campaignapi.datetime.date.fromisoformat(today)
                 - campaignapi.datetime.timedelta(days=1)).isoformat()
    client, auth = keyed_client(db, warmup=(3, 10), warmup_start=yesterday)
    record = client.get("/v1/deliverability/0", headers=auth).json["data"]["deliverability"]
    assert record["warmup"] == {"day": "2", "cap": "10", "sent_today": "3"}


def test_deliverability_answers_only_id_0_and_needs_read(db, client, make_key):
    assert_error(client.get("/v1/deliverability/1", headers=make_key(), expect_errors=True),
                 404, "not_found")
    assert_error(client.get("/v1/deliverability/0", headers=make_key(levels=("write",)),
                            expect_errors=True), 403, "insufficient_access")
    record = client.get("/v1/deliverability/0", headers=make_key()).json["data"]["deliverability"]
    assert record == {"id": "0", "domains": [],
                      "warmup": {"day": None, "cap": None, "sent_today": "0"}}


@pytest.mark.parametrize("settings", [
    {"domain_rates": ["gmail.com=0/m"]}, {"domain_rates": ["gmail.com=5/d"]},
    {"domain_rates": ["not a domain=5/m"]}, {"domain_rates": {"gmail.com": "fast"}},
    {"warmup": "50,x"}, {"warmup": "0,10"}, {"warmup": "5", "warmup_start": "2026-13-01"}])
def test_settings_that_cannot_be_read_are_refused_at_start(db, settings):
    with pytest.raises(ValueError):
        campaignapi.create_app(db, **settings)


@pytest.mark.parametrize("command, argument", [
    ("worker", "--domain-rate=gmail.com"), ("worker", "--domain-rate=*=1/w"),
    ("worker", "--warmup=1,,x"), ("serve", "--warmup-start=tomorrow"),
    ("serve", "--spam-threshold=high"), ("serve", "--spam-threshold=nan")])
def test_the_command_line_refuses_bad_settings_in_one_line(db, command, argument):
    done = subprocess.run([sys.executable, "campaignapi.py", command, "--db", db, argument],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr


def test_slow_down_replies_are_told_from_other_deferrals():
    # internal: the rule of section 20 is a pure function of the reply
    slows = campaignapi._slows_down
    assert slows(421, GMAIL_421.split(" ", 1)[1])
    assert slows(451, "4.7.650 The mail server has been temporarily rate limited")
    assert slows(454, "Throttling failure: Maximum sending rate exceeded.")
    assert slows(450, "4.7.1 Too many messages from your IP")
    assert not slows(451, "4.3.0 Temporary system problem, try again later")
    assert not slows(452, "4.2.2 Mailbox full")
    # internal: the alias table
    domain = campaignapi._rate_domain
    assert [domain(a) for a in ("a@GoogleMail.com", "b@hotmail.co.uk", "c@live.fr", "d@msn.com",
                                "e@outlook.com", "f@liveshow.com", "g@example.org")] == [
        "gmail.com", "outlook.com", "outlook.com", "outlook.com", "outlook.com", "liveshow.com",
        "example.org"]


def test_transactional_emails_count_toward_the_warmup_and_are_never_held(db):
    # The admission of claimed rows, given rows of the kinds that other parts queue
    # (transactional and automation emails), as a claim hands them over.
    campaignapi.init_db(db)
    pace = campaignapi._Pace(warmup="2")  # internal: the kinds are not queued in this part
    rows = [{"id": n, "kind": kind, "to_addr": f"r{n}@example.org"} for n, kind in enumerate(
        ["transactional", "campaign", "automation", "transactional", "campaign"], start=1)]
    now = int(time.time())
    with database(db) as conn, campaignapi.transaction(conn):
        going = pace.admit(conn, rows, now)
        day = conn.execute("SELECT * FROM send_day").fetchone()
    # Day one's cap is 2: the first transactional email and the campaign email fill it; the
    # automation and the last campaign email wait, the second transactional one goes.
    assert [row["id"] for row in going] == [1, 2, 4]
    assert (day["sent"], day["bulk"]) == (3, 1)
