"""Tooling beside the relay: the benchmark, the demo, a local broker, scratch databases.

Imported only by the commands that use them, never by the relay or the operations commands.
"""
