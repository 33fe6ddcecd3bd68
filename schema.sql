-- campaignapi schema.
--
-- Applied by campaignapi.create_app() to a new database; every statement is
-- idempotent (IF NOT EXISTS), so applying it to an existing database keeps its
-- data.  The version lives in PRAGMA user_version, set by the code after this
-- script has run (see SCHEMA_VERSION in campaignapi.py).
--
-- Conventions: times are TEXT 'YYYY-MM-DD HH:MM:SS' in UTC, flags are INTEGER
-- 0/1, lists that belong to one row are JSON TEXT.  Ids are INTEGER PRIMARY KEY
-- so that "create at a chosen free id" is a plain INSERT with that id.
-- The tables written row by row in bulk (recipient, outbox) spell their
-- CHECK lists with OR: for `x IN (a, b, c)` SQLite builds a temporary table
-- again for every row an executemany writes, which doubled an import's cost.

-- Key/value settings of this installation (the app secret for signed tokens).
CREATE TABLE IF NOT EXISTS setting (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS account (
    id      INTEGER PRIMARY KEY,
    email   TEXT NOT NULL UNIQUE COLLATE NOCASE,
    created TEXT NOT NULL DEFAULT (datetime('now'))
);

-- Only the SHA-256 of a secret is kept; secrets carry 256 bits of randomness,
-- so a slow password hash would add latency to every request and no safety.
CREATE TABLE IF NOT EXISTS apikey (
    id      INTEGER PRIMARY KEY,
    account INTEGER NOT NULL REFERENCES account(id),
    name    TEXT NOT NULL DEFAULT '',
    levels  TEXT NOT NULL,                 -- comma-separated: read,write,create,delete
    hash    TEXT NOT NULL UNIQUE,
    created TEXT NOT NULL DEFAULT (datetime('now')),
    expires TEXT,                          -- NULL: never
    revoked INTEGER NOT NULL DEFAULT 0 CHECK (revoked IN (0, 1))
);

-- Addresses that must not receive an account's campaigns any more.  An
-- unsubscribe replaces a bounce, never the other way round.
CREATE TABLE IF NOT EXISTS suppression (
    account  INTEGER NOT NULL REFERENCES account(id),
    email    TEXT NOT NULL COLLATE NOCASE,
    reason   TEXT NOT NULL
             CHECK (reason = 'unsubscribed' OR reason = 'bounced' OR reason = 'complained'),
    campaign INTEGER,                      -- whose email led to it (archive counts); NULL: unknown
    created  TEXT NOT NULL DEFAULT (datetime('now')),
    PRIMARY KEY (account, email)
) WITHOUT ROWID;

-- Datasources ----------------------------------------------------------------

CREATE TABLE IF NOT EXISTS datasource (
    id          INTEGER PRIMARY KEY,
    owner       INTEGER NOT NULL REFERENCES account(id),
    name        TEXT NOT NULL,
    description TEXT NOT NULL DEFAULT '',
    origin      TEXT NOT NULL DEFAULT 'api' CHECK (origin IN ('import', 'signup', 'api')),
    created     TEXT NOT NULL DEFAULT (datetime('now')),
    deleted     INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1)),
    -- Public sign-ups (version 2): the form takes them when signup = 1; with
    -- doubleoptin they stay 'unconfirmed' until the link in the confirmation
    -- email (message confirmmessage, else a built-in one) is followed; the
    -- welcome message goes once they are active; both sent as fromprofile.
    signup         INTEGER NOT NULL DEFAULT 0 CHECK (signup IN (0, 1)),
    doubleoptin    INTEGER NOT NULL DEFAULT 1 CHECK (doubleoptin IN (0, 1)),
    confirmmessage INTEGER,
    welcomemessage INTEGER,
    fromprofile    INTEGER,
    -- version 10: the language of its public pages and built-in emails
    language       TEXT NOT NULL DEFAULT 'en' CHECK (language IN ('en', 'de', 'fr', 'es', 'nl'))
);
CREATE INDEX IF NOT EXISTS datasource_owner ON datasource(owner, deleted);

-- Recipient values live in recipient.data as a JSON object keyed by field id
-- (not name), so renaming a field touches one row here and none there.
CREATE TABLE IF NOT EXISTS field (
    id         INTEGER PRIMARY KEY,
    datasource INTEGER NOT NULL REFERENCES datasource(id),
    name       TEXT NOT NULL COLLATE NOCASE,
    type       TEXT NOT NULL CHECK (type IN ('text', 'integer', 'number', 'boolean',
                                             'date', 'datetime', 'email')),
    label      TEXT NOT NULL DEFAULT '',   -- version 10: shown on the sign-up form
    UNIQUE (datasource, name)
);

CREATE TABLE IF NOT EXISTS import (
    id           INTEGER PRIMARY KEY,
    datasource   INTEGER NOT NULL REFERENCES datasource(id),
    name         TEXT NOT NULL DEFAULT '',
    originalfile TEXT NOT NULL DEFAULT '',
    uploadtype   TEXT NOT NULL CHECK (uploadtype IN ('csv', 'base64', 'json')),
    status       TEXT NOT NULL DEFAULT 'finished',
    rows         INTEGER NOT NULL DEFAULT 0,
    inserted     INTEGER NOT NULL DEFAULT 0,
    updated      INTEGER NOT NULL DEFAULT 0,
    skipped      INTEGER NOT NULL DEFAULT 0,
    errors       TEXT NOT NULL DEFAULT '[]',   -- JSON [{row, error}], the first 100
    created      TEXT NOT NULL DEFAULT (datetime('now')),
    finished     TEXT
);
CREATE INDEX IF NOT EXISTS import_datasource ON import(datasource);

-- One row per address and datasource; the address is compared without case.
CREATE TABLE IF NOT EXISTS recipient (
    id         INTEGER PRIMARY KEY,
    datasource INTEGER NOT NULL REFERENCES datasource(id),
    email      TEXT NOT NULL COLLATE NOCASE,
    data       TEXT NOT NULL DEFAULT '{}',      -- JSON {field id: value}
    status     TEXT NOT NULL DEFAULT 'active'
               CHECK (status = 'active' OR status = 'unconfirmed' OR status = 'unsubscribed'
                      OR status = 'bounced' OR status = 'complained'),
    import     INTEGER REFERENCES import(id) ON DELETE SET NULL,  -- the import that inserted it
    created    TEXT NOT NULL DEFAULT (datetime('now')),
    updated    TEXT NOT NULL DEFAULT (datetime('now')),
    confirm_sent TEXT,                          -- when the last confirmation email was queued
    UNIQUE (datasource, email)
);
-- No index on email alone: lookups by address name the datasources
-- (suppress() does, for all of an account's), so the unique index serves
-- them, and a second index on a random key cost an import over 10%.
CREATE INDEX IF NOT EXISTS recipient_status ON recipient(datasource, status);
CREATE INDEX IF NOT EXISTS recipient_import ON recipient(import);
-- Sign-ups still unconfirmed, for the worker that removes them after 7 days
-- (partial: imports write 'active' rows and never touch it).
CREATE INDEX IF NOT EXISTS recipient_unconfirmed ON recipient(updated) WHERE status = 'unconfirmed';
-- Addresses with characters beyond ASCII, for verify's warning about them
-- (partial: a handful of a list; verify read every address of a segment for
-- them, and an import pays only the test of each address).  The predicate is
-- SQL["sqlite"]["non_ascii"] of email, which _pg_schema() spells for PostgreSQL.
CREATE INDEX IF NOT EXISTS recipient_non_ascii ON recipient(datasource, status) WHERE length(CAST(email AS BLOB)) != length(email);

CREATE TABLE IF NOT EXISTS export (
    id         INTEGER PRIMARY KEY,
    datasource INTEGER NOT NULL REFERENCES datasource(id),
    status     TEXT NOT NULL DEFAULT 'running' CHECK (status IN ('running', 'finished', 'failed')),
    rows       INTEGER NOT NULL DEFAULT 0,
    token      TEXT NOT NULL UNIQUE,           -- the download link's secret part
    path       TEXT,                           -- the stored CSV file
    expires    TEXT NOT NULL,
    created    TEXT NOT NULL DEFAULT (datetime('now')),
    finished   TEXT
);
CREATE INDEX IF NOT EXISTS export_datasource ON export(datasource);

CREATE TABLE IF NOT EXISTS organize (
    id        INTEGER PRIMARY KEY,
    item      INTEGER NOT NULL UNIQUE REFERENCES datasource(id),
    folder    TEXT NOT NULL DEFAULT '',
    sortorder INTEGER NOT NULL DEFAULT 0
);

-- Messages, segments, sender profiles -----------------------------------------

CREATE TABLE IF NOT EXISTS message (
    id          INTEGER PRIMARY KEY,
    owner       INTEGER NOT NULL REFERENCES account(id),
    name        TEXT NOT NULL DEFAULT '',
    subject     TEXT NOT NULL DEFAULT '',
    fromname    TEXT NOT NULL DEFAULT '',
    fromaddress TEXT NOT NULL DEFAULT '',
    replyto     TEXT NOT NULL DEFAULT '',
    html        TEXT NOT NULL DEFAULT '',
    text        TEXT NOT NULL DEFAULT '',
    created     TEXT NOT NULL DEFAULT (datetime('now')),
    deleted     INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1))
);
CREATE INDEX IF NOT EXISTS message_owner ON message(owner, deleted);

CREATE TABLE IF NOT EXISTS segment (
    id          INTEGER PRIMARY KEY,
    owner       INTEGER NOT NULL REFERENCES account(id),
    name        TEXT NOT NULL DEFAULT '',
    datasources TEXT NOT NULL DEFAULT '[]',    -- JSON [datasource id]
    match       TEXT NOT NULL DEFAULT 'all' CHECK (match IN ('all', 'any')),
    conditions  TEXT NOT NULL DEFAULT '[]',    -- JSON [{field, op, value}]
    created     TEXT NOT NULL DEFAULT (datetime('now')),
    deleted     INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1))
);
CREATE INDEX IF NOT EXISTS segment_owner ON segment(owner, deleted);

CREATE TABLE IF NOT EXISTS accountprofile (
    id          INTEGER PRIMARY KEY,
    owner       INTEGER NOT NULL REFERENCES account(id),
    name        TEXT NOT NULL DEFAULT '',
    fromname    TEXT NOT NULL DEFAULT '',
    fromaddress TEXT NOT NULL DEFAULT '',
    replyto     TEXT NOT NULL DEFAULT '',
    created     TEXT NOT NULL DEFAULT (datetime('now')),
    deleted     INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1))
);
CREATE INDEX IF NOT EXISTS accountprofile_owner ON accountprofile(owner, deleted);

-- Campaigns -------------------------------------------------------------------

-- `scheduled` is not stored: a campaign is scheduled while it has a batch that
-- is 'scheduled' (waiting for its time).  `archiveid` is the campaign's own id.
CREATE TABLE IF NOT EXISTS campaign (
    id              INTEGER PRIMARY KEY,
    owner           INTEGER NOT NULL REFERENCES account(id),
    accountprofile  INTEGER NOT NULL,
    name            TEXT NOT NULL,
    description     TEXT NOT NULL DEFAULT '',
    enabled         INTEGER NOT NULL DEFAULT 1 CHECK (enabled IN (0, 1)),
    archiveemail    TEXT,
    defaulttemplate TEXT NOT NULL DEFAULT '',
    thumbnail       TEXT,
    created         TEXT NOT NULL DEFAULT (datetime('now')),
    deleted         INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1)),
    tracking        INTEGER NOT NULL DEFAULT 0 CHECK (tracking IN (0, 1)),  -- version 2
    -- version 7: A/B tests of the links with variants (the share tested, in
    -- percent; what chooses the winner; seconds from the test to the choice)
    testsize        INTEGER NOT NULL DEFAULT 20 CHECK (testsize BETWEEN 10 AND 50),
    testmetric      TEXT NOT NULL DEFAULT 'opens' CHECK (testmetric IN ('opens', 'clicks')),
    testwait        INTEGER NOT NULL DEFAULT 14400 CHECK (testwait BETWEEN 60 AND 604800),
    public          INTEGER NOT NULL DEFAULT 0 CHECK (public IN (0, 1))     -- version 10: archive
);
CREATE INDEX IF NOT EXISTS campaign_owner ON campaign(owner, deleted);

-- A link of a message to a segment in a campaign.  Sending goes by priority,
-- lower numbers first, then by id; an address in several segments receives
-- only the message of the first.
CREATE TABLE IF NOT EXISTS campaign_message (
    id       INTEGER PRIMARY KEY,
    campaign INTEGER NOT NULL REFERENCES campaign(id),
    segment  INTEGER NOT NULL REFERENCES segment(id),
    message  INTEGER NOT NULL REFERENCES message(id),
    priority INTEGER NOT NULL DEFAULT 0 CHECK (priority >= 0),
    -- version 7: other messages tested against this one (a JSON array of ids)
    variants TEXT NOT NULL DEFAULT '[]',
    UNIQUE (campaign, segment, message)
);

CREATE TABLE IF NOT EXISTS batch (
    id        INTEGER PRIMARY KEY,
    campaign  INTEGER NOT NULL REFERENCES campaign(id),
    timestamp TEXT NOT NULL,                   -- when it is due, UTC
    status    TEXT NOT NULL DEFAULT 'scheduled'
              CHECK (status IN ('scheduled', 'testing', 'sending', 'sent', 'cancelled')),
    base_url  TEXT NOT NULL DEFAULT '',        -- where links in its emails point
    recipients INTEGER NOT NULL DEFAULT 0,
    created   TEXT NOT NULL DEFAULT (datetime('now')),
    finished  TEXT,
    -- version 2: the campaign's tracking when the batch was made; its emails
    -- are tracked by it, whatever the campaign says later
    tracking  INTEGER NOT NULL DEFAULT 0 CHECK (tracking IN (0, 1))
);
CREATE INDEX IF NOT EXISTS batch_due ON batch(status, timestamp);
CREATE INDEX IF NOT EXISTS batch_campaign ON batch(campaign);

-- Version 7: the A/B test of each link with variants in a batch: its
-- versions (a JSON array of message ids, the link's own first), the
-- campaign's testmetric when the batch was made, when the worker chooses, the
-- choice ('auto' or 'manual'; '' until made) and the versions' figures at the
-- choice (JSON, as the batch archive shows them).
CREATE TABLE IF NOT EXISTS batch_test (
    batch     INTEGER NOT NULL REFERENCES batch(id),
    link      INTEGER NOT NULL,
    versions  TEXT NOT NULL,
    metric    TEXT NOT NULL CHECK (metric IN ('opens', 'clicks')),
    due       TEXT NOT NULL,
    result    TEXT,
    winner    INTEGER,
    decided   TEXT NOT NULL DEFAULT '' CHECK (decided IN ('', 'auto', 'manual')),
    decidedat TEXT,
    PRIMARY KEY (batch, link)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS batch_test_due ON batch_test(decided, due);

-- Each message as rendered for a batch (the batch archive).
CREATE TABLE IF NOT EXISTS batch_message (
    batch   INTEGER NOT NULL REFERENCES batch(id),
    message INTEGER NOT NULL,
    subject TEXT NOT NULL,
    html    TEXT NOT NULL,
    text    TEXT NOT NULL,
    -- version 5: the html as a tracked batch sends it (track_html(), once per
    -- batch): merge tags, {{open_url}} and {{click_url_N}} filled at delivery
    tracked TEXT,
    PRIMARY KEY (batch, message)
) WITHOUT ROWID;

-- The datasources whose recipients a batch's segments drew from (version 10),
-- written when the batch is made: a datasource's public archive reads its
-- batches here rather than in the outbox.
CREATE TABLE IF NOT EXISTS batch_datasource (
    datasource INTEGER NOT NULL,
    batch      INTEGER NOT NULL REFERENCES batch(id),
    PRIMARY KEY (datasource, batch)
) WITHOUT ROWID;

-- The outbox: every email the service sends.  A campaign email names its
-- batch, message and recipient and is rendered at delivery from the batch's
-- prepared message; a test send carries its prepared message (merge tags
-- filled at delivery); other mail (notifications, archive copies, sign-up
-- emails) carries its ready subject and body.
-- Status: queued -> sending (claimed by a worker) -> sent | failed, back to
-- queued for a retry; 'skipped' when the recipient unsubscribed, bounced or
-- was removed between queueing and delivery.  'waiting' (version 7): a
-- recipient of a tested link who gets the winner; until it is chosen the row
-- names the link's own message.
CREATE TABLE IF NOT EXISTS outbox (
    id          INTEGER PRIMARY KEY,
    account     INTEGER NOT NULL REFERENCES account(id),
    kind        TEXT NOT NULL
                CHECK (kind = 'campaign' OR kind = 'archive' OR kind = 'notification'
                       OR kind = 'signup' OR kind = 'test' OR kind = 'automation'
                       OR kind = 'transactional'),
    batch       INTEGER REFERENCES batch(id),
    message     INTEGER,
    recipient   INTEGER,
    to_addr     TEXT NOT NULL COLLATE NOCASE,
    subject     TEXT,
    body        TEXT,                          -- plain text
    html        TEXT,                          -- optional HTML alternative
    status      TEXT NOT NULL DEFAULT 'queued'
                CHECK (status = 'queued' OR status = 'sending' OR status = 'sent'
                       OR status = 'failed' OR status = 'skipped' OR status = 'waiting'),
    attempts    INTEGER NOT NULL DEFAULT 0,    -- delivery attempts made
    next_try    TEXT NOT NULL DEFAULT (datetime('now')),
    claimed_by  TEXT,                          -- the worker sending it; a claim older
    claimed_at  TEXT,                          -- than 10 minutes is taken back
    attempt_started TEXT,                      -- set (committed) just before the SMTP
                                               -- attempt, cleared with its result: a dead
                                               -- worker's row with it set may have arrived,
                                               -- so it is failed, never sent again
    error       TEXT,                          -- the last SMTP reply or error
    created     TEXT NOT NULL DEFAULT (datetime('now')),
    sent        TEXT,
    -- The sender of a ready-made email (a sign-up's confirmation or welcome, a
    -- test send), from a sender profile; empty: the worker's --mail-from.
    fromname    TEXT,
    fromaddress TEXT,
    replyto     TEXT,
    -- version 5: a test send names its campaign (the List-Id and the
    -- unsubscribe link it carries) and where its links point, without a batch
    campaign    INTEGER,
    base_url    TEXT,
    -- version 6: an email of a prepared message (an automation's, a
    -- transactional one) names it, and is rendered from it at delivery with the
    -- merge values of its recipient row, else of merge_values (JSON {name: value})
    prepared     INTEGER,
    merge_values TEXT,
    -- version 8: claimed before every row of a lower priority that is due
    -- (1: a transactional email; 0: the rest)
    priority     INTEGER NOT NULL DEFAULT 0
);
-- A batch never queues one address twice, even when the worker runs again
-- after a crash.
CREATE UNIQUE INDEX IF NOT EXISTS outbox_once ON outbox(batch, to_addr) WHERE kind = 'campaign';
CREATE INDEX IF NOT EXISTS outbox_due ON outbox(status, next_try);
-- Delivery claims in this order: the first rows of a higher priority, then by time.
CREATE INDEX IF NOT EXISTS outbox_claim ON outbox(status, priority DESC, next_try);
CREATE INDEX IF NOT EXISTS outbox_batch ON outbox(batch, status);
-- Bounces and complaints find the emails sent to an address (soft bounces in a
-- row, the accounts that mailed it lately).
CREATE INDEX IF NOT EXISTS outbox_address ON outbox(to_addr, account);

-- Version 2 --------------------------------------------------------------------

-- Templates wrap a campaign's messages: html and text hold {{content}} once.
CREATE TABLE IF NOT EXISTS template (
    id      INTEGER PRIMARY KEY,
    owner   INTEGER NOT NULL REFERENCES account(id),
    name    TEXT NOT NULL DEFAULT '',
    html    TEXT NOT NULL DEFAULT '',
    text    TEXT NOT NULL DEFAULT '',
    created TEXT NOT NULL DEFAULT (datetime('now')),
    deleted INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1))
);
CREATE INDEX IF NOT EXISTS template_owner ON template(owner, deleted);

-- Addresses erased from an account (a recipient deleted for real): only a
-- keyed one-way hash stays, so an import or sign-up of the same address is
-- recognised and never mailed without a new confirmation.
CREATE TABLE IF NOT EXISTS erasure (
    account INTEGER NOT NULL REFERENCES account(id),
    hash    TEXT NOT NULL,
    created TEXT NOT NULL DEFAULT (datetime('now')),
    PRIMARY KEY (account, hash)
) WITHOUT ROWID;

-- What happened to the emails of a campaign, one row an event: opens,
-- clicks, unsubscribes, bounces (hard and soft) and complaints.  The archive
-- figures are counted from it.  No foreign keys: events are written by public
-- routes at any rate and must never wait on, or be lost with, other rows.
CREATE TABLE IF NOT EXISTS event (
    id       INTEGER PRIMARY KEY,
    account  INTEGER NOT NULL,
    kind     TEXT NOT NULL
             CHECK (kind = 'open' OR kind = 'click' OR kind = 'unsubscribe' OR kind = 'bounce'
                    OR kind = 'softbounce' OR kind = 'complaint'),
    campaign INTEGER,                          -- NULL: not tied to a campaign's email
    batch    INTEGER,
    outbox   INTEGER,                          -- the email it is about, when known
    email    TEXT COLLATE NOCASE,
    link     INTEGER,                          -- a click: the link's index in its message
    created  TEXT NOT NULL DEFAULT (datetime('now')),
    prepared INTEGER                           -- version 6: the email's prepared message
);
-- The statistics of a batch are read from this index alone (it covers every
-- column they count), and a campaign's events outside its batches (an
-- unsubscribe by a link of the first release) from event_campaign.
CREATE INDEX IF NOT EXISTS event_batch ON event(batch, kind, outbox, link, created);
CREATE INDEX IF NOT EXISTS event_campaign ON event(campaign, batch, kind);
CREATE INDEX IF NOT EXISTS event_address ON event(account, email, created);
-- A soft bounce counts once per email (a delay warning and the final failure
-- of one email are one soft bounce), also when two reports arrive at once.
CREATE UNIQUE INDEX IF NOT EXISTS event_softbounce_once ON event(outbox)
    WHERE kind = 'softbounce' AND outbox IS NOT NULL;

-- The links of each message as a batch sent it, by index: a click token
-- names (outbox email, index) and redirects only to the URL stored here.
CREATE TABLE IF NOT EXISTS batch_link (
    batch   INTEGER NOT NULL REFERENCES batch(id),
    message INTEGER NOT NULL,
    link    INTEGER NOT NULL,
    url     TEXT NOT NULL,
    PRIMARY KEY (batch, message, link)
) WITHOUT ROWID;

-- Webhooks: where an account's events are POSTed, signed with its secret.
CREATE TABLE IF NOT EXISTS webhook (
    id          INTEGER PRIMARY KEY,
    owner       INTEGER NOT NULL REFERENCES account(id),
    url         TEXT NOT NULL,
    events      TEXT NOT NULL DEFAULT '[]',    -- JSON [kind]; [] for every kind
    enabled     INTEGER NOT NULL DEFAULT 1 CHECK (enabled IN (0, 1)),
    secret      TEXT NOT NULL,                 -- whsec_...: shown once, at create
    lastattempt TEXT,
    lasterror   TEXT,
    failures    INTEGER NOT NULL DEFAULT 0,    -- events given up on after 24 hours
    created     TEXT NOT NULL DEFAULT (datetime('now')),
    deleted     INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1))
);
CREATE INDEX IF NOT EXISTS webhook_owner ON webhook(owner, deleted);

-- Every event raised for an account that has a webhook wanting it, stored in
-- the transaction of the change that caused it, and one delivery per webhook.
CREATE TABLE IF NOT EXISTS hook_event (
    id      INTEGER PRIMARY KEY,
    account INTEGER NOT NULL REFERENCES account(id),
    kind    TEXT NOT NULL,
    payload TEXT NOT NULL,                     -- the JSON body sent, as sent
    created TEXT NOT NULL DEFAULT (datetime('now'))
);
CREATE TABLE IF NOT EXISTS hook_delivery (
    id         INTEGER PRIMARY KEY,
    webhook    INTEGER NOT NULL REFERENCES webhook(id),
    event      INTEGER NOT NULL REFERENCES hook_event(id),
    status     TEXT NOT NULL DEFAULT 'pending'
               CHECK (status = 'pending' OR status = 'delivered' OR status = 'failed'),
    attempts   INTEGER NOT NULL DEFAULT 0,
    next_try   TEXT NOT NULL DEFAULT (datetime('now')),
    error      TEXT,
    claimed_by TEXT,
    claimed_at TEXT,
    created    TEXT NOT NULL DEFAULT (datetime('now')),
    finished   TEXT
);
CREATE INDEX IF NOT EXISTS hook_delivery_due ON hook_delivery(status, webhook, id);

-- SQLite's id sequences: the last id of each table whose creates take ids
-- (see ID_REACH in campaignapi.py).  PostgreSQL keeps them in the identity
-- sequences; there this table stays empty.
CREATE TABLE IF NOT EXISTS id_sequence (
    name TEXT PRIMARY KEY,
    last INTEGER NOT NULL
) WITHOUT ROWID;

-- Public writes kept for later: an open, a click, an unsubscribe, a sign-up or
-- a confirm that arrives while a long transaction (a big import) holds the
-- lock it needs is kept here, and applied in order as soon as the lock is free
-- (see "Public writes that never wait" in campaignapi.py).  On SQLite the rows
-- live in a file of their own beside the database (its name + '.intake'),
-- since the database's one write lock is what they must not wait for; there
-- this table stays empty.  AUTOINCREMENT: ids are never used twice, so the
-- last id applied marks what is done.
CREATE TABLE IF NOT EXISTS intake (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    kind    TEXT NOT NULL,                     -- a key of LATER
    payload TEXT NOT NULL,                     -- its arguments, JSON
    created TEXT NOT NULL DEFAULT (datetime('now'))
);

-- Version 6 --------------------------------------------------------------------

-- A prepared message: what an email that is not part of a batch (an
-- automation's step, a transactional email) is built from at delivery, made
-- once for its scope (what its statistics count under, e.g. 'automation:7:2')
-- and made again only when its inputs (digest) change: the message in its
-- template with its CSS inlined, the tracked html (as batch_message.tracked)
-- with its links in prepared_link, the sender, the List-Id, where its links
-- point, and whether it is bulk mail (List-Unsubscribe, {{unsubscribe_url}}).
CREATE TABLE IF NOT EXISTS prepared (
    id          INTEGER PRIMARY KEY,
    account     INTEGER NOT NULL REFERENCES account(id),
    scope       TEXT NOT NULL,
    digest      TEXT NOT NULL,
    message     INTEGER,
    subject     TEXT NOT NULL,
    html        TEXT NOT NULL,
    text        TEXT NOT NULL,
    tracked     TEXT,                          -- NULL: not tracked
    fromname    TEXT NOT NULL DEFAULT '',
    fromaddress TEXT NOT NULL DEFAULT '',
    replyto     TEXT NOT NULL DEFAULT '',
    list_id     TEXT NOT NULL DEFAULT '',      -- '': no List-Id header
    base_url    TEXT NOT NULL DEFAULT '',      -- '': the worker's public_url
    bulk        INTEGER NOT NULL DEFAULT 1 CHECK (bulk IN (0, 1)),
    created     TEXT NOT NULL DEFAULT (datetime('now')),
    UNIQUE (scope, digest)
);
-- The links of a tracked prepared message by index, as batch_link for a batch.
CREATE TABLE IF NOT EXISTS prepared_link (
    prepared INTEGER NOT NULL REFERENCES prepared(id),
    link     INTEGER NOT NULL,
    url      TEXT NOT NULL,
    PRIMARY KEY (prepared, link)
) WITHOUT ROWID;
-- The statistics of a prepared message, as event_batch for a batch (it
-- covers every column they count), and whether one of its emails was opened.
CREATE INDEX IF NOT EXISTS event_prepared ON event(prepared, outbox, kind, link, created)
    WHERE prepared IS NOT NULL;
CREATE INDEX IF NOT EXISTS outbox_prepared ON outbox(prepared, status) WHERE prepared IS NOT NULL;

-- Version 8 --------------------------------------------------------------------

-- Requests that carried an Idempotency-Key: claimed (status NULL) before the
-- request runs, then its 2xx answer kept for 24 hours in the transaction of
-- its writes; a failed request's row is removed, so the key can be used again.
-- scope: 'account:<id>', or 'client:<address>' on the public routes.
-- request: SHA-256 of the method, path, query string and body.  token: the
-- claim's own, so that a request whose claim was taken over (its process
-- ended, _KEY_LEASE) cannot keep its answer.
CREATE TABLE IF NOT EXISTS idempotency_key (
    scope   TEXT NOT NULL,
    key     TEXT NOT NULL,
    request TEXT NOT NULL,
    token   TEXT NOT NULL,
    status  INTEGER,                           -- NULL: the request still runs
    answer  TEXT,                              -- JSON: its data, or a page and headers
    created TEXT NOT NULL,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_key_created ON idempotency_key(created);

-- A transactional email (PUT /v1/transactional/0): one message to one address
-- now, sent as its outbox email (status, error and times are that row's).
CREATE TABLE IF NOT EXISTS transactional (
    id      INTEGER PRIMARY KEY,
    owner   INTEGER NOT NULL REFERENCES account(id),
    to_addr TEXT NOT NULL COLLATE NOCASE,
    message INTEGER NOT NULL REFERENCES message(id),
    outbox  INTEGER REFERENCES outbox(id),    -- set in the transaction that writes the row
    created TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS transactional_owner ON transactional(owner, to_addr);

-- Deliverability (version 9).  A receiving domain's pace, shared by every
-- worker of the database: emails admitted in the current window of its rate
-- (fixed windows of the rate's unit, aligned to the clock), the rate now
-- (halved after a "slow down" deferral, raised a tenth each quiet 10
-- minutes) and totals.  A domain is named after the alias table
-- (googlemail.com is gmail.com; hotmail.*, outlook.*, live.*, msn.com are
-- outlook.com).  Times are Unix seconds.
CREATE TABLE IF NOT EXISTS domain_pace (
    domain      TEXT PRIMARY KEY,
    configured  REAL,                        -- the setting's emails a unit; NULL: no rate
    unit        INTEGER NOT NULL DEFAULT 1,  -- the rate's unit in seconds: 1, 60 or 3600
    rate        REAL,                        -- the rate now; NULL: the configured one
    win         INTEGER NOT NULL DEFAULT 0,  -- start of the current window
    used        INTEGER NOT NULL DEFAULT 0,  -- emails admitted in it
    full_until  INTEGER NOT NULL DEFAULT 0,  -- its end once used reached the rate
    slowed      INTEGER NOT NULL DEFAULT 0,  -- the last "slow down" deferral
    halved      INTEGER NOT NULL DEFAULT 0,  -- the last halving
    raised      INTEGER NOT NULL DEFAULT 0,  -- the last raise by a tenth
    sent        INTEGER NOT NULL DEFAULT 0,  -- totals (GET /metrics)
    deferred    INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS domain_pace_full ON domain_pace(full_until);
-- Emails sent and deferred per domain and minute (Unix seconds // 60), kept
-- two hours: the last hour's figures of GET /v1/deliverability/0.
CREATE TABLE IF NOT EXISTS domain_minute (
    domain      TEXT NOT NULL,
    minute      INTEGER NOT NULL,
    sent        INTEGER NOT NULL DEFAULT 0,
    deferred    INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (domain, minute)
);
CREATE INDEX IF NOT EXISTS domain_minute_age ON domain_minute(minute);
-- Emails handed to the relay each UTC day that the warm-up counts:
-- campaign, automation and transactional ones (``bulk``: the first two).
CREATE TABLE IF NOT EXISTS send_day (
    day         TEXT PRIMARY KEY,            -- YYYY-MM-DD
    sent        INTEGER NOT NULL DEFAULT 0,
    bulk        INTEGER NOT NULL DEFAULT 0
);

-- The emails of prepared messages a recipient got (an automation's
-- continue_if looks whether the email of an earlier step was opened).
CREATE INDEX IF NOT EXISTS outbox_prepared_recipient ON outbox(recipient, prepared)
    WHERE prepared IS NOT NULL;

-- Automations: a sequence of steps (JSON [{send|wait|continue_if|update}])
-- that each recipient of a datasource walks on their own, in a run.
-- trigger is JSON with "type" first ({"type":"subscribed"}, {"type":"date",
-- ...}, {"type":"api"}); enabled_at: since when the subscribed trigger takes
-- recipients; checked: when the date trigger was last evaluated; base_url:
-- where the links of its emails point.
CREATE TABLE IF NOT EXISTS automation (
    id              INTEGER PRIMARY KEY,
    owner           INTEGER NOT NULL REFERENCES account(id),
    name            TEXT NOT NULL,
    datasource      INTEGER NOT NULL,
    trigger         TEXT NOT NULL,
    steps           TEXT NOT NULL,
    accountprofile  INTEGER NOT NULL,
    defaulttemplate TEXT NOT NULL DEFAULT '',
    tracking        INTEGER NOT NULL DEFAULT 0 CHECK (tracking IN (0, 1)),
    enabled         INTEGER NOT NULL DEFAULT 0 CHECK (enabled IN (0, 1)),
    base_url        TEXT NOT NULL DEFAULT '',
    checked         TEXT,
    created         TEXT NOT NULL DEFAULT (datetime('now')),
    deleted         INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1))
);
CREATE INDEX IF NOT EXISTS automation_owner ON automation(owner, deleted);
CREATE INDEX IF NOT EXISTS automation_datasource ON automation(datasource)
    WHERE enabled = 1 AND deleted = 0;

-- A recipient's walk through an automation: step is the index of the next
-- step, due when it runs (waiting runs only); paused while the automation is
-- disabled.  origin names why it started ('subscribed', 'date:YYYY-MM-DD',
-- 'date:YYYY' for a yearly date, NULL by hand): once per recipient and origin.
-- No foreign key on recipient: an erased recipient's run stops.
CREATE TABLE IF NOT EXISTS automation_run (
    id         INTEGER PRIMARY KEY,
    automation INTEGER NOT NULL REFERENCES automation(id),
    recipient  INTEGER NOT NULL,
    step       INTEGER NOT NULL DEFAULT 0,
    status     TEXT NOT NULL DEFAULT 'waiting'
               CHECK (status = 'waiting' OR status = 'finished' OR status = 'stopped'
                      OR status = 'cancelled'),
    due        TEXT,
    paused     INTEGER NOT NULL DEFAULT 0 CHECK (paused IN (0, 1)),
    origin     TEXT,
    started    TEXT NOT NULL,
    finished   TEXT,
    history    TEXT NOT NULL DEFAULT '[]'      -- JSON [{step, at, outcome}]
);
-- The worker's look for due runs reads this index alone: runs that are not
-- due (or paused) cost nothing.
CREATE INDEX IF NOT EXISTS automation_run_due ON automation_run(due)
    WHERE status = 'waiting' AND paused = 0;
CREATE INDEX IF NOT EXISTS automation_run_automation ON automation_run(automation, status);
-- At most one waiting run per recipient and automation; one run per origin.
CREATE UNIQUE INDEX IF NOT EXISTS automation_run_waiting ON automation_run(automation, recipient)
    WHERE status = 'waiting';
CREATE UNIQUE INDEX IF NOT EXISTS automation_run_once ON automation_run(automation, recipient, origin)
    WHERE origin IS NOT NULL;
