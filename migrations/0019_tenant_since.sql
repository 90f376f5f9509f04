-- When an endpoint's tenant last changed (issue #30): the tenant portal shows a tenant the
-- deliveries of its endpoints made since each became its own, so that an endpoint handed from
-- one tenant to another (`endpoints update --tenant`, or plain SQL) never shows the new tenant
-- what the old one was sent. NULL: the tenant it has had since it was created. Set by a
-- trigger, whatever writes the change. Nullable without a default: adding it rewrites nothing.
-- Not among the columns whose change NOTIFYs the relays (migration 0006's trigger).
ALTER TABLE outbox_endpoints ADD COLUMN tenant_since timestamptz;

CREATE FUNCTION outbox_endpoints_tenant_since() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.tenant IS DISTINCT FROM OLD.tenant THEN
        -- The time of the change itself, not of its transaction's start: a fan-out that
        -- commits between the two wrote its deliveries for the tenant before.
        NEW.tenant_since := clock_timestamp();
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER outbox_endpoints_tenant_since
    BEFORE UPDATE OF tenant ON outbox_endpoints
    FOR EACH ROW EXECUTE FUNCTION outbox_endpoints_tenant_since();

-- A tenant's endpoints, as the portal reads them at every request (outbox_endpoints_match_idx
-- leads with the destination and holds enabled ones only). The endpoints table is small: built
-- in the migration's transaction, it holds back writes to it for a moment.
CREATE INDEX outbox_endpoints_tenant_idx ON outbox_endpoints (tenant, id);
