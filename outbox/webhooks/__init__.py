"""What both ends of a webhook need: the application that registers endpoints or receives
webhooks (``outbox.endpoints``, ``outbox.inbox.webhooks``) and the relay that sends them.
Standard Webhooks signatures (``signing``), which URLs may be targets (``urls``), and which
addresses may be reached (``ssrf``). Nothing here imports the relay."""
