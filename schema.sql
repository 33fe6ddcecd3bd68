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
    fromprofile    INTEGER
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
    tracking        INTEGER NOT NULL DEFAULT 0 CHECK (tracking IN (0, 1))   -- version 2
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
    UNIQUE (campaign, segment, message)
);

CREATE TABLE IF NOT EXISTS batch (
    id        INTEGER PRIMARY KEY,
    campaign  INTEGER NOT NULL REFERENCES campaign(id),
    timestamp TEXT NOT NULL,                   -- when it is due, UTC
    status    TEXT NOT NULL DEFAULT 'scheduled'
              CHECK (status IN ('scheduled', 'sending', 'sent', 'cancelled')),
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

-- The outbox: every email the service sends.  A campaign email names its
-- batch, message and recipient and is rendered at delivery from the batch's
-- prepared message; a test send carries its prepared message (merge tags
-- filled at delivery); other mail (notifications, archive copies, sign-up
-- emails) carries its ready subject and body.
-- Status: queued -> sending (claimed by a worker) -> sent | failed, back to
-- queued for a retry; 'skipped' when the recipient unsubscribed, bounced or
-- was removed between queueing and delivery.
CREATE TABLE IF NOT EXISTS outbox (
    id          INTEGER PRIMARY KEY,
    account     INTEGER NOT NULL REFERENCES account(id),
    kind        TEXT NOT NULL
                CHECK (kind = 'campaign' OR kind = 'archive' OR kind = 'notification'
                       OR kind = 'signup' OR kind = 'test'),
    batch       INTEGER REFERENCES batch(id),
    message     INTEGER,
    recipient   INTEGER,
    to_addr     TEXT NOT NULL COLLATE NOCASE,
    subject     TEXT,
    body        TEXT,                          -- plain text
    html        TEXT,                          -- optional HTML alternative
    status      TEXT NOT NULL DEFAULT 'queued'
                CHECK (status = 'queued' OR status = 'sending' OR status = 'sent'
                       OR status = 'failed' OR status = 'skipped'),
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
    base_url    TEXT
);
-- A batch never queues one address twice, even when the worker runs again
-- after a crash.
CREATE UNIQUE INDEX IF NOT EXISTS outbox_once ON outbox(batch, to_addr) WHERE kind = 'campaign';
CREATE INDEX IF NOT EXISTS outbox_due ON outbox(status, next_try);
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
    created  TEXT NOT NULL DEFAULT (datetime('now'))
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
