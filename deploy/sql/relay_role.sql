-- The relay's least-privilege login role: it reads, claims, updates and deletes rows of the
-- outbox table, reads the paused destinations (outbox_paused; `outbox-relay pause` is run by
-- an operator's role), registers itself in outbox_relays, fans events out to the endpoints
-- registered at runtime (reading outbox_endpoints and writing only their health and
-- disabled state, and clearing previous secrets past their window; the application
-- registers them and writes their secrets), claims and records outbox_deliveries and
-- logs attempts in outbox_attempts, and nothing else. (LISTEN and advisory locks need no
-- privilege.)
--
--   psql "$OWNER_URL" -v ON_ERROR_STOP=1 -v role=outbox_relay -v password="$RELAY_PASSWORD" \
--        -v schema=public -f deploy/sql/relay_role.sql
--
-- Run it after `outbox-relay migrate`, connected to the application's database as the role
-- that ran migrate (the table's owner) if it has CREATEROLE, or as a superuser. Running it
-- again is safe: the role is created once; the password and the grants are set again.
--
-- `outbox-relay migrate` itself runs as the schema's owner (usually the role your service's
-- own migrations use): it needs CREATE on the database when the schema does not exist yet,
-- otherwise CREATE on the schema. The relay never runs DDL.
\set ON_ERROR_STOP on

SELECT format('CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION', :'role')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'role') \gexec

ALTER ROLE :"role" WITH LOGIN PASSWORD :'password';

SELECT format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), :'role') \gexec
GRANT USAGE ON SCHEMA :"schema" TO :"role";
GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE :"schema".outbox TO :"role";
GRANT SELECT ON TABLE :"schema".outbox_paused TO :"role";
GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE :"schema".outbox_relays TO :"role";
GRANT SELECT ON TABLE :"schema".outbox_endpoints TO :"role";
GRANT UPDATE (failing_since, last_success_at, enabled, disabled_at, disabled_reason, updated_at,
              circuit_open_until, previous_secret, previous_secret_until)
    ON TABLE :"schema".outbox_endpoints TO :"role";
GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE :"schema".outbox_deliveries TO :"role";
GRANT SELECT, INSERT, DELETE ON TABLE :"schema".outbox_attempts TO :"role";
GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE :"schema".outbox_batches TO :"role";
