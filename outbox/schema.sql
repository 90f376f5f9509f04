-- The functions and triggers of migrations 0001 and 0003 (the outbox's wake-up and ordering
-- fence), 0006 (the endpoints' wake-up) and 0019 (an endpoint's tenant_since), created with their tables by SQLAlchemy's
-- metadata.create_all, so a schema managed with Alembic gets them too: outbox/schema.py loads
-- them (binds="named", though they have none). The drift test checks they match what the
-- migrations create. {schema} is the schema's quoted name and a dot, or nothing (the search
-- path).

-- name: notify_function

CREATE FUNCTION {schema}outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, '');
    RETURN NULL;
END
$$

-- name: notify_trigger

CREATE TRIGGER outbox_notify AFTER INSERT ON {schema}outbox
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}outbox_notify()

-- name: fence_function

CREATE FUNCTION {schema}outbox_fence_lock() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
DECLARE
    -- SECURITY DEFINER: reading the sequence needs a privilege INSERT alone does not give.
    last bigint := least(coalesce(pg_sequence_last_value(
        pg_get_serial_sequence(quote_ident(TG_TABLE_SCHEMA) || '.' || quote_ident(TG_TABLE_NAME),
                               'id')::regclass), 0), 281474976710655);
BEGIN
    PERFORM pg_advisory_xact_lock_shared(
        4611686018427387904 + ((1 + mod(TG_RELID::bigint, 16383)) << 48) + last);
    PERFORM pg_advisory_xact_lock_shared(4611686018427387904 + last);
    RETURN NULL;
END
$$

-- name: fence_trigger

CREATE TRIGGER outbox_fence_lock BEFORE INSERT ON {schema}outbox
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}outbox_fence_lock()

-- name: endpoints_notify_function

CREATE FUNCTION {schema}outbox_endpoints_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.outbox', 'endpoints');
    RETURN NULL;
END
$$

-- name: endpoints_notify_trigger

CREATE TRIGGER outbox_endpoints_notify
    AFTER INSERT OR DELETE OR UPDATE OF destination, url, tenant, event_types, secret,
        previous_secret, previous_secret_until, rate_limit, enabled
    ON {schema}outbox_endpoints
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}outbox_endpoints_notify()

-- name: endpoints_tenant_since_function

CREATE FUNCTION {schema}outbox_endpoints_tenant_since() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.tenant IS DISTINCT FROM OLD.tenant THEN
        -- The time of the change itself, not of its transaction's start: a fan-out that
        -- commits between the two wrote its deliveries for the tenant before.
        NEW.tenant_since := clock_timestamp();
    END IF;
    RETURN NEW;
END
$$

-- name: endpoints_tenant_since_trigger

CREATE TRIGGER outbox_endpoints_tenant_since
    BEFORE UPDATE OF tenant ON {schema}outbox_endpoints
    FOR EACH ROW EXECUTE FUNCTION {schema}outbox_endpoints_tenant_since()
