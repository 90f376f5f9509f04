"""``outbox-relay bench``: measure the relay on your own machine and database."""
