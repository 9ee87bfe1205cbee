"""The free blocks in eviction order: the head is reused (and its cached contents evicted) first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from conveyor.engine.core.kv_block import KVCacheBlock


class FreeBlockQueue:
    """A queue of free blocks with O(1) pop from the head, append and removal from the middle.

    Backed by an OrderedDict, which is a hash map over a doubly linked list written
    in C: the same operations as a hand-made linked list through the blocks, with
    less code and less time per operation. Order is the eviction policy: blocks are
    appended when freed (least recently used at the head), and a block that a
    prefix-cache hit takes back is removed from wherever it sits.
    """

    __slots__ = ("_blocks",)

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._blocks: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in blocks
        )

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self._blocks.values())

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._blocks

    def popleft(self) -> KVCacheBlock:
        """The next block to reuse; IndexError when empty."""
        if not self._blocks:
            raise IndexError("no free blocks")
        return self._blocks.popitem(last=False)[1]

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail: it will be reused after every block already queued."""
        self._blocks[block.block_id] = block

    def remove(self, block: KVCacheBlock) -> None:
        del self._blocks[block.block_id]

    def block_ids(self) -> list[int]:
        """Block ids head first, the order they will be reused in."""
        return list(self._blocks)
