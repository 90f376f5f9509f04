"""Keys land on the partition the Java client and aiokafka would choose: every producer of a
topic must agree, or one key's messages are split across partitions and lose their order."""

from __future__ import annotations

import os

import pytest
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.partitioner import murmur2 as aiokafka_murmur2

from relay.sinks.kafka import partitioner
from relay.sinks.kafka.partitioner import Partitioner, murmur2

# org.apache.kafka.common.utils.UtilsTest#testMurmur2 (signed 32-bit results).
JAVA = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


def test_the_compiled_hash_is_used() -> None:
    # The wheel exists for the platforms we ship on; without it the relay still works, slower.
    assert partitioner.COMPILED


@pytest.mark.parametrize(("key", "signed"), sorted(JAVA.items()))
def test_murmur2_matches_the_java_client(key: bytes, signed: int) -> None:
    assert murmur2(key) & 0xFFFFFFFF == signed & 0xFFFFFFFF
    assert aiokafka_murmur2(key) & 0xFFFFFFFF == signed & 0xFFFFFFFF


def test_every_key_lands_where_aiokafka_puts_it() -> None:
    ours, theirs = Partitioner(), DefaultPartitioner()
    for length in range(0, 70):
        for _ in range(20):
            key = os.urandom(length)
            for parts in ([0], [0, 1, 2], list(range(12)), [3, 5, 7]):
                assert ours(key, parts, parts) == theirs(key, parts, parts)


def test_a_message_without_a_key_goes_to_an_available_partition() -> None:
    p = Partitioner()
    assert {p(None, [0, 1, 2, 3], [2]) for _ in range(50)} == {2}
    assert {p(None, [0, 1], []) for _ in range(200)} == {0, 1}
