"""The tenant portal (issue #30): what one tenant of an ``endpoints`` destination may see and
do, opened by a token its application minted (outbox/endpoints/portal_tokens.py). Everything
here is scoped to the token's tenant in SQL (relay/portal/queries.sql)."""
