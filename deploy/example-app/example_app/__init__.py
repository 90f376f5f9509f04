"""A small order service that writes each order and its ``order.created`` event together."""
