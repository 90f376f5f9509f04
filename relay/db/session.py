"""Settings every database session of the relay, its console and its commands starts with.

JIT is off. PostgreSQL compiles a statement whose estimated cost passes ``jit_above_cost``
(100,000 by default) with LLVM before running it, and estimates over a large backlog pass that
bound easily. The relay's statements are short and run again and again: the pending gauges'
count over a backlog of 150,000 rows, about 100 ms to run, took 1.2 s to compile, at every
``stats_interval``, and a tenth of the machine's CPU on a drain went to LLVM
(docs/performance.md, "JIT"). The console's and the commands' counts are as short.
"""

from __future__ import annotations

SESSION_SETTINGS: dict[str, str] = {"jit": "off"}
