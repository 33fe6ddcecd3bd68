"""Verify counts each segment's audience in one pass (issue 31): the sizes it
reports and its warning about non-ASCII addresses are the figures counted
here in Python from the rows, for segments over one and over two
datasources (an address in both, in another case, counts once), with and
without a field condition.  On both engines."""

import re

import pytest

import campaignapi

from helpers import database, import_csv, make_campaign

ONE = ["ann@example.com", "bob@example.com", "zoë@example.com", "carl@example.com"]
# In another case only where the case is ASCII's, which both engines fold alike.
TWO = ["ANN@example.com", "dora@example.com", "ZOë@example.com", "émile@example.com"]
CITY = {("ann@example.com", 1): "Paris", ("bob@example.com", 1): "Oslo",
        ("zoë@example.com", 1): "Paris", ("carl@example.com", 1): "Lima",
        ("ann@example.com", 2): "Paris", ("dora@example.com", 2): "Paris",
        ("zoë@example.com", 2): "Rome", ("émile@example.com", 2): "Paris"}
ASCII_FOLD = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def city(address, datasource):
    return CITY[address.translate(ASCII_FOLD), datasource]


def expected(addresses):
    """(size, non-ASCII addresses, the least of them) as verify should tell
    them, addresses folded as the email column compares them."""
    odd = {a.translate(ASCII_FOLD) for a in addresses if not a.isascii()}
    return len({a.translate(ASCII_FOLD) for a in addresses}), len(odd), min(odd, default=None)


def checks(api, campaign):
    report = api.get(f"/campaign/{campaign}/verify/0")["verify"]
    return {check["check"]: check for check in report["checks"]}


PARIS = {"field": "city", "op": "eq", "value": "paris"}


@pytest.mark.parametrize("condition, indexed", [(None, False), (PARIS, False), (PARIS, True)],
                         ids=["everyone", "paris", "paris-indexed"])
@pytest.mark.parametrize("both", [False, True])
def test_verify_reports_the_sizes_and_addresses_counted_from_the_rows(api, db, both, condition,
                                                                      indexed):
    fields = [{"name": "city", "type": "text"}]
    first = api.put("/datasource/0", name="one", fields=fields)["id"]
    second = api.put("/datasource/0", name="two", fields=fields)["id"]
    import_csv(api, first, "email,city\n" + "".join(f"{a},{city(a, 1)}\n" for a in ONE))
    import_csv(api, second, "email,city\n" + "".join(f"{a},{city(a, 2)}\n" for a in TWO))
    ids = make_campaign(api, [int(first), int(second)] if both else [int(first)])
    if condition:
        api.post(f"/segment/{ids['segment']}", conditions=[condition])
    if indexed:
        # internal: the worker's step that makes the index of the condition's field
        assert campaignapi._index_conditioned_fields(db, limit=100) == (2 if both else 1)
    rows = [(a, city(a, 1)) for a in ONE] + ([(a, city(a, 2)) for a in TWO] if both else [])
    chosen = [a for a, c in rows if condition is None or c.lower() == condition["value"]]
    size, odd, least = expected(chosen)
    found = checks(api, ids["campaign"])
    assert found["segment_recipients"]["message"].endswith(
        f"(segment {ids['segment']}: {size}).")
    assert api.get(f"/segment/{ids['segment']}")["segment"]["size"] == str(size)
    note = found["non_ascii_addresses"]["message"]
    if odd:
        counted = re.search(r"holds (\d+) address\(es\) with non-ASCII characters \(such as "
                            r"([^)]+)\)", note)
        assert counted and (int(counted[1]), counted[2].translate(ASCII_FOLD)) == (odd, least), \
            note
    else:
        assert "No segment holds" in note


@pytest.mark.parametrize("condition", [None, PARIS], ids=["everyone", "paris-indexed"])
def test_the_non_ascii_count_reads_only_those_addresses(db, api, condition):
    """Verify's count of non-ASCII addresses uses the partial index of them
    (schema.sql: recipient_non_ascii) instead of reading every address of the
    segment, also when the segment's condition has a field index that the
    planner would take for the whole WHERE: the plan says so, on both engines
    (PostgreSQL told not to scan the table, as it would for a table this
    small)."""
    ds = api.put("/datasource/0", name="one", fields=[{"name": "city", "type": "text"}])["id"]
    import_csv(api, ds, "email,city\n" + "".join(f"{a},{city(a, 1)}\n" for a in ONE))
    segment = api.put("/segment/0", name="s", datasources=[int(ds)],
                      conditions=[condition] if condition else [])["id"]
    # internal: the worker's step that makes the index of the condition's field
    assert campaignapi._index_conditioned_fields(db, limit=100) == (1 if condition else 0)
    with database(db) as conn:
        row = conn.execute("SELECT * FROM segment WHERE id = ?", (int(segment),)).fetchone()
        # internal: verify's statement, whose plan is the point
        sql, params = campaignapi._non_ascii_sql(conn, row)
        if conn.engine == "sqlite":
            plan = " ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, params))
        else:
            conn.execute("SET enable_seqscan = off")
            plan = " ".join(row[0] for row in conn.execute("EXPLAIN " + sql, params))
        assert "recipient_non_ascii" in plan, plan
        assert tuple(conn.execute(sql, params).fetchone()) == (1, "zoë@example.com")
