"""Plain-int counters of the drafting tiers, read by the metrics exporter (`snapshot()` gives flat names)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from protos.specmesh.v1 import common_pb2

TIER_NAMES: dict[int, str] = {common_pb2.DRAFT_SOURCE_CACHE: "cache", common_pb2.DRAFT_SOURCE_NGRAM: "ngram",
              common_pb2.DRAFT_SOURCE_MODEL: "model"}


@dataclass
class TierCounters:
    hits: int = 0                # rounds this tier supplied the draft
    misses: int = 0              # rounds it was asked and had none
    drafted: int = 0             # draft tokens it proposed
    accepted: int = 0            # of those, accepted by the verifier


@dataclass
class DraftingStats:
    tiers: dict[str, TierCounters] = field(default_factory=lambda: {n: TierCounters() for n in TIER_NAMES.values()})
    draft_bytes_sent: int = 0        # serialized ProposeRequest bytes to the draft service
    draft_bytes_received: int = 0    # serialized ProposeResponse bytes from it
    prefetch_sent: int = 0           # next-block Proposes sent while the verifier worked
    prefetch_hits: int = 0           # ... whose guess came true: a round drafted without waiting on the draft link
    tree_drafts: int = 0             # suffix drafting: rounds drafted as a token tree (branches, or model + suffix)

    def tier(self, source: int) -> TierCounters | None:
        name = TIER_NAMES.get(source)
        return self.tiers[name] if name else None

    def snapshot(self) -> dict[str, int]:
        """{'cache_hits': .., 'model_accepted': .., 'draft_bytes_sent': ..}"""
        out = {f"{name}_{f.name}": getattr(c, f.name) for name, c in self.tiers.items() for f in fields(c)}
        out["draft_bytes_sent"] = self.draft_bytes_sent
        out["draft_bytes_received"] = self.draft_bytes_received
        out["prefetch_sent"], out["prefetch_hits"] = self.prefetch_sent, self.prefetch_hits
        out["tree_drafts"] = self.tree_drafts
        return out
