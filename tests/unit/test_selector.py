"""The lighthouse's selector: demoted sockets a batch per select, every other one whenever ready, none lost."""

from __future__ import annotations

import asyncio
import math
import selectors
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.coord.selector import BulkCappedSelector, LoopSelector


@contextmanager
def readable_pairs(count: int) -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """``count`` connected socket pairs whose first end has a byte to read."""
    pairs = [socket.socketpair() for _ in range(count)]
    try:
        for _, writer in pairs:
            writer.send(b"x")
        yield pairs
    finally:
        for reader, writer in pairs:
            reader.close()
            writer.close()


@settings(max_examples=40, deadline=None)
@given(bulk=st.integers(0, 40), priority=st.integers(0, 6), cap=st.integers(1, 16))
def test_every_ready_priority_socket_each_select_and_the_bulk_in_turns_of_at_most_cap(
    bulk: int, priority: int, cap: int
) -> None:
    selector = BulkCappedSelector(bulk_per_select=cap)
    with readable_pairs(bulk + priority) as pairs, selector:
        readers = [reader for reader, _ in pairs]
        for number, reader in enumerate(readers):
            selector.register(reader, selectors.EVENT_READ, data=number)
        for reader in readers[:bulk]:
            assert selector.demote(reader)
        assert selector.bulk == bulk
        seen: set[int] = set()
        for _ in range(math.ceil(bulk / cap) if bulk else 1):
            ready = selector.select(0)
            numbers = [key.data for key, events in ready if events == selectors.EVENT_READ]
            assert len(numbers) == len(ready)
            assert set(range(bulk, bulk + priority)) <= set(numbers), "every ready priority socket, every time"
            bulk_numbers = [number for number in numbers if number < bulk]
            assert len(bulk_numbers) == min(cap, bulk)
            seen.update(bulk_numbers)
        assert seen == set(range(bulk)), "the bulk takes turns: each ready socket within ceil(bulk / cap) selects"


def test_modify_and_unregister_reach_a_demoted_socket_and_closed_ones_are_not_reported() -> None:
    selector = BulkCappedSelector(bulk_per_select=1)
    with readable_pairs(2) as pairs, selector:
        (first, _), (second, _) = pairs
        selector.register(first, selectors.EVENT_READ, "first")
        selector.register(second, selectors.EVENT_READ, "second")
        selector.demote(first)
        key = selector.modify(first, selectors.EVENT_READ | selectors.EVENT_WRITE, "first, writing")
        assert selector.get_key(first) == key and selector.get_key(first.fileno()) == key
        assert {(k.data, events) for k, events in selector.select(0)} == {
            ("first, writing", selectors.EVENT_READ | selectors.EVENT_WRITE),
            ("second", selectors.EVENT_READ),
        }
        assert selector.unregister(first).data == "first, writing"
        assert [k.data for k, _ in selector.select(0)] == ["second"]
        assert len(selector.get_map()) == 1 and selector.bulk == 0
        assert not selector.demote(first), "not registered"
        with pytest.raises(KeyError):
            selector.unregister(first)
        with pytest.raises(KeyError):
            selector.register(second, selectors.EVENT_READ)
        with pytest.raises(ValueError, match="bulk_per_select must be in"):
            BulkCappedSelector(bulk_per_select=0)


def test_an_asyncio_loop_over_it_serves_demoted_connections_and_new_ones_alike() -> None:
    """A real server on the lighthouse's loop: 30 demoted connections (a batch of 4 per select) and new ones all
    echo every line, and a connection accepted while the demoted ones are busy is answered too."""
    loop_selector = LoopSelector()
    loop = loop_selector.new_loop()
    selector = loop_selector.capped
    assert isinstance(selector, BulkCappedSelector)
    selector.bulk_per_select = 4

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            if line == b"demote\n":
                selector.demote(writer.get_extra_info("socket"))
            writer.write(line)
            await writer.drain()
        writer.close()

    async def scenario() -> list[bytes]:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        streams = [await asyncio.open_connection("127.0.0.1", port) for _ in range(30)]
        for _, writer in streams:
            writer.write(b"demote\n")
        assert [await reader.readline() for reader, _ in streams] == [b"demote\n"] * 30
        for _, writer in streams:
            writer.write(b"ping\n" * 5)
        late_reader, late_writer = await asyncio.open_connection("127.0.0.1", port)
        late_writer.write(b"healthz\n")
        answers = [await asyncio.wait_for(late_reader.readline(), 30)]
        for reader, _ in streams:
            answers.extend([await reader.readline() for _ in range(5)])
        for _, writer in [*streams, (late_reader, late_writer)]:
            writer.close()
        server.close()
        await server.wait_closed()
        return answers

    try:
        answers = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert answers == [b"healthz\n"] + [b"ping\n"] * 150
    assert selector.bulk == 0, "closed connections left the bulk"
