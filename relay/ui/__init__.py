"""The operator console (``outbox-relay ui``, or ``[ui] enabled = true`` in the relay): web
pages over the same functions as the operations commands. See relay/ui/app.py."""
