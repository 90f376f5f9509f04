-- The statements of the endpoints API (outbox.endpoints, webhooks for many receivers),
-- through SQLAlchemy's text(): binds as written (:name), loaded by outbox/queries.py with
-- binds="named". {endpoints} and {deliveries} are the schema's tables, filled in by
-- outbox.queries.render_endpoints. The relay's statements about secrets at rest are in
-- endpoint_secrets.sql.
--
-- Written out in full in each statement, and alike (tests/test_sql_files.py): the endpoint's
-- columns (what a statement returns for outbox.endpoints.model), and endpoint_holds_sealed's
-- EXISTS, which endpoint_create and endpoint_rotate test too.

-- name: endpoint_create
-- A secret in clear (no key here) is inserted only where none is encrypted (the EXISTS of
-- endpoint_holds_sealed); the check and the insert are one statement in the caller's
-- transaction, so it sees what committed before it and the caller's own writes. No row back:
-- refused (the caller says why).
-- params: destination, url, tenant, event_types, secret, rate_limit, description

INSERT INTO {endpoints} (destination, url, tenant, event_types, secret, rate_limit, description)
SELECT CAST(:destination AS text), CAST(:url AS text), CAST(:tenant AS text),
       CAST(:event_types AS text[]), CAST(:secret AS text), CAST(:rate_limit AS integer),
       CAST(:description AS text)
WHERE CAST(:secret AS text) LIKE 'enc:%' OR NOT EXISTS (SELECT 1 FROM {endpoints}
        WHERE secret LIKE 'enc:%' OR previous_secret LIKE 'enc:%')
RETURNING
id, destination, url, tenant, event_types, secret, previous_secret, previous_secret_until,
rate_limit, description, enabled, disabled_reason, disabled_at, failing_since,
last_success_at, created_at, updated_at

-- name: endpoint_holds_sealed
-- Whether any endpoint's secret, current or previous, is encrypted: then a writer without the
-- key must not store one in clear beside them (it would be a downgrade the relays never
-- notice). EXISTS stops at the first such row, which where secrets are encrypted is about the
-- first row read; only a table of plaintext secrets is read whole (one row per registered
-- endpoint, and only by writers without a key).
SELECT EXISTS (SELECT 1 FROM {endpoints}
        WHERE secret LIKE 'enc:%' OR previous_secret LIKE 'enc:%')

-- name: endpoint_get
-- params: id
SELECT
id, destination, url, tenant, event_types, secret, previous_secret, previous_secret_until,
rate_limit, description, enabled, disabled_reason, disabled_at, failing_since,
last_success_at, created_at, updated_at
FROM {endpoints} WHERE id = :id

-- name: endpoint_list
-- params: destination, tenant
SELECT
id, destination, url, tenant, event_types, secret, previous_secret, previous_secret_until,
rate_limit, description, enabled, disabled_reason, disabled_at, failing_since,
last_success_at, created_at, updated_at
FROM {endpoints}
WHERE (CAST(:destination AS text) IS NULL OR destination = :destination)
  AND (CAST(:tenant AS text) IS NULL OR tenant = :tenant)
ORDER BY id

-- name: endpoint_update
-- Each :set_x says whether x is changed, so that "set to NULL" and "leave as it is" differ.
-- params: set_url, url, set_tenant, tenant, set_event_types, event_types, set_rate_limit, rate_limit, set_description, description, id

UPDATE {endpoints} SET
    url = CASE WHEN :set_url THEN :url ELSE url END,
    -- A new URL starts its health afresh: the old one's failures are not its own.
    failing_since = CASE WHEN :set_url AND url IS DISTINCT FROM :url THEN NULL
                         ELSE failing_since END,
    tenant = CASE WHEN :set_tenant THEN :tenant ELSE tenant END,
    event_types = CASE WHEN :set_event_types THEN CAST(:event_types AS text[])
                       ELSE event_types END,
    rate_limit = CASE WHEN :set_rate_limit THEN CAST(:rate_limit AS integer) ELSE rate_limit END,
    description = CASE WHEN :set_description THEN :description ELSE description END,
    updated_at = now()
WHERE id = :id
RETURNING
id, destination, url, tenant, event_types, secret, previous_secret, previous_secret_until,
rate_limit, description, enabled, disabled_reason, disabled_at, failing_since,
last_success_at, created_at, updated_at

-- name: endpoint_disable
-- params: reason, id

UPDATE {endpoints}
SET enabled = false,
    -- Disabling a disabled endpoint keeps when and why it was (an auto-disable's reason).
    disabled_reason = CASE WHEN enabled THEN CAST(:reason AS text)
                           ELSE coalesce(CAST(:reason AS text), disabled_reason) END,
    disabled_at = CASE WHEN enabled THEN now() ELSE disabled_at END,
    updated_at = now()
WHERE id = :id
RETURNING
id, destination, url, tenant, event_types, secret, previous_secret, previous_secret_until,
rate_limit, description, enabled, disabled_reason, disabled_at, failing_since,
last_success_at, created_at, updated_at

-- name: endpoint_enable
-- Enabling starts its health afresh: the failures before it was disabled do not count again.
-- Enabling an endpoint sends everything queued for it: its pending deliveries (kept, with
-- their events, while it was disabled) become due now, whatever backoff they were waiting out
-- when it was disabled. Only when it was disabled: enabling an enabled endpoint changes
-- nothing. One UPDATE of its backlog not yet due, read from the claim's waiting lane
-- (outbox_deliveries_waiting_idx), which holds all of it: a delivery of the fresh lane was due
-- when it was written (run_after <= created_at).
-- params: id

WITH due AS (
    UPDATE {deliveries} AS d SET run_after = now()
    WHERE d.endpoint_id = CAST(:id AS bigint) AND d.run_after > now()
      AND d.status = 'pending' AND (d.claims <> 0 OR d.replay OR d.run_after > d.created_at)
      AND EXISTS (SELECT 1 FROM {endpoints} AS e WHERE e.id = CAST(:id AS bigint)
                  AND NOT e.enabled)
)
UPDATE {endpoints}
SET enabled = true, disabled_reason = NULL, disabled_at = NULL, failing_since = NULL,
    updated_at = now()
WHERE id = :id
RETURNING
id, destination, url, tenant, event_types, secret, previous_secret, previous_secret_until,
rate_limit, description, enabled, disabled_reason, disabled_at, failing_since,
last_success_at, created_at, updated_at

-- name: endpoint_rotate
-- One previous secret at a time: while it is still valid, only a rotation that drops it at
-- once (keep_seconds = 0, a leaked secret) goes through. A new secret in clear goes in only
-- where none is encrypted: not this row's (tested on the row itself, so that if another writer
-- changes it meanwhile, the test is made again on its newest version once that commits) and
-- no other row's (endpoint_holds_sealed's EXISTS). The others change no row, and the caller
-- reads endpoint_get to say why.
-- params: keep_seconds, secret, id

UPDATE {endpoints}
SET previous_secret = CASE WHEN :keep_seconds > 0 THEN secret END,
    previous_secret_until = CASE WHEN :keep_seconds > 0
                                 THEN now() + make_interval(secs => :keep_seconds) END,
    secret = :secret,
    updated_at = now()
WHERE id = :id
  AND (:keep_seconds = 0 OR previous_secret_until IS NULL OR previous_secret_until <= now())
  AND (CAST(:secret AS text) LIKE 'enc:%'
       OR (secret NOT LIKE 'enc:%' AND coalesce(previous_secret, '') NOT LIKE 'enc:%'
           AND NOT EXISTS (SELECT 1 FROM {endpoints}
        WHERE secret LIKE 'enc:%' OR previous_secret LIKE 'enc:%')))
RETURNING
id, destination, url, tenant, event_types, secret, previous_secret, previous_secret_until,
rate_limit, description, enabled, disabled_reason, disabled_at, failing_since,
last_success_at, created_at, updated_at

-- name: endpoint_seal_previous
-- After a rotation with a key of a secret stored in clear (a table encrypted since): the
-- secret that still signs for a while is stored encrypted too. The row is this transaction's
-- (locked by the rotation).
-- params: previous, id

UPDATE {endpoints} SET previous_secret = :previous WHERE id = :id RETURNING id

-- name: endpoint_reencrypt_read
-- Re-encryption under a new key (`outbox-relay endpoints reencrypt`), a batch per transaction
-- in id order. The batch is locked: a writer rotating one of its secrets meanwhile waits, and
-- then rotates what this wrote (never the other way round). A previous secret past its window
-- signs nothing any more: it is reported as expired, to be cleared rather than re-encrypted.
-- params: after_id, limit

SELECT id, secret, previous_secret,
       previous_secret IS NOT NULL AND NOT coalesce(previous_secret_until > now(), false)
           AS previous_expired
FROM {endpoints}
WHERE id > :after_id
ORDER BY id
LIMIT :limit
FOR UPDATE

-- name: endpoint_reencrypt_write
-- Only the rows the batch changes; a cleared previous secret takes its window with it.
-- params: ids, secrets, previous

UPDATE {endpoints} AS e
SET secret = v.secret,
    previous_secret = v.previous_secret,
    previous_secret_until = CASE WHEN v.previous_secret IS NULL THEN NULL
                                 ELSE e.previous_secret_until END
FROM unnest(CAST(:ids AS bigint[]), CAST(:secrets AS text[]), CAST(:previous AS text[]))
         AS v(id, secret, previous_secret)
WHERE e.id = v.id
RETURNING e.id

-- name: endpoint_delete
-- Deleting ends the endpoint's unfinished deliveries first (same statement): they can never be
-- sent, and the log says why.
-- params: id

WITH gone AS (
    DELETE FROM {endpoints} WHERE id = CAST(:id AS bigint) RETURNING 1
),
cancelled AS (
    UPDATE {deliveries}
    SET status = 'cancelled', finished_at = now(), locked_by = NULL, locked_until = NULL,
        last_error = 'endpoint ' || CAST(:id AS bigint) || ' was deleted'
    WHERE endpoint_id = CAST(:id AS bigint) AND status IN ('pending', 'running')
      AND EXISTS (SELECT 1 FROM gone)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, (SELECT count(*) FROM cancelled) AS cancelled
