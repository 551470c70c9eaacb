"""Cache pages as integers and hashes: the page pool (ref counts, chained hashes, LRU prompt
cache, partial-page records) and the defragmentation planner. No tensors here."""

from dyngen_core.pages.defrag import DefragPlan, fragmentation, plan_defrag
from dyngen_core.pages.pool import (
    MIN_PARTIAL_MATCH,
    ROOT_HASH,
    PagePool,
    PagePoolExhaustedError,
    chain_hash,
)

__all__ = [
    "MIN_PARTIAL_MATCH",
    "ROOT_HASH",
    "DefragPlan",
    "PagePool",
    "PagePoolExhaustedError",
    "chain_hash",
    "fragmentation",
    "plan_defrag",
]
