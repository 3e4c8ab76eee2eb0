"""Where a node's relay takes the chunks it sends (:class:`StoreSource`), apart from
:mod:`.relay_runtime` so that module keeps to one idea (and under ~600 lines)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from echo2.protocol.wire import ENC_MANIFEST

if TYPE_CHECKING:
    from .relay_runtime import RelayNode


class StoreSource:
    """The node's :class:`~echo2.protocol.net.relaydriver.ChunkSource`: the encoded bytes kept
    since they were verified, else re-encoded from the chunk store in a worker thread."""

    def __init__(self, node: RelayNode) -> None:
        self.node = node

    def ready(self, version: int, index: int) -> tuple[bytearray, bytes] | None:
        b = self.node.bc  # the frame as received, unless this node is set to corrupt what it sends
        ok = b is not None and b.version == version and not self.node.cfg.corrupt_sends
        return b.frames.get(index) if ok and b is not None else None

    async def encoded(self, version: int, index: int) -> tuple[int, bytes | memoryview]:
        node = self.node
        b = node.bc
        if b is None or b.version != version:
            raise KeyError(version)
        cached = b.encoded.get(index)
        if cached is not None:
            flag, data = ENC_MANIFEST, cached
        else:
            flag, data = await trio.to_thread.run_sync(node.store.encoded_for, b.manifest, index)
        if node.cfg.corrupt_sends:
            bad = bytearray(data)
            bad[len(bad) // 2] ^= 0xFF
            data = bytes(bad)
        return flag, data

    async def full(self, version: int, index: int) -> bytes:
        raise KeyError("a node serves no full encodings")
