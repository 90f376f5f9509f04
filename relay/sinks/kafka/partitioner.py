"""Kafka's default partitioning: a keyed message goes to murmur2(key) modulo the partitions,
as the Java client and aiokafka's DefaultPartitioner place it, so that every producer of a
topic agrees on where a key's messages go (their order depends on it).

aiokafka computes murmur2 in pure Python: 2 µs for a short key and 9 µs for a UUID-sized
one on the benchmark machine, more than the rest of the relay's work on a Kafka event. The
``murmurhash2`` package computes the same function in compiled code (0.25 µs); it is used
where installed, aiokafka's own otherwise. tests/test_kafka_partitioner.py holds both to the
Java client's published values.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from aiokafka.partitioner import murmur2 as _python_murmur2

# Kafka's seed (org.apache.kafka.common.utils.Utils.murmur2).
SEED = 0x9747B28C

murmur2: Callable[[bytes], int]
try:
    from murmurhash2 import murmurhash2 as _compiled
except ImportError:  # pragma: no cover - a platform without its wheel
    murmur2 = _python_murmur2
    COMPILED = False
else:

    def murmur2(data: bytes) -> int:
        return int(_compiled(data, SEED))

    COMPILED = True


class Partitioner:
    """aiokafka's DefaultPartitioner, with the compiled hash: given to the producer too, so
    that the messages it partitions itself (sent one by one) land where the batches do."""

    def __call__(
        self, key: bytes | None, all_partitions: Sequence[int], available: Sequence[int]
    ) -> int:
        if key is None:
            return random.choice(available or all_partitions)
        return all_partitions[(murmur2(key) & 0x7FFFFFFF) % len(all_partitions)]
