"""A model's speculative decoding as /status reports it (wire/status.py `ModelStatus.speculative`).

Counts are the engine's totals across the model's loads (engine/speculative.py): tokens the
draft proposed and tokens the target accepted. `off_reason` says why a model configured with a
draft decodes without one (the in-process transformers engine: continuous batching).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# A backend's word on speculative decoding for one answer (the transformers engine: why its
# draft is not used); the front passes it on to the client unchanged.
SPECULATIVE_HEADER = "X-Modelyard-Speculative"


@dataclass(frozen=True, slots=True)
class SpeculativeStatus:
    draft_model: str
    drafted: int = 0
    accepted: int = 0
    off_reason: str | None = None

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted; None before anything was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    def to_json(self) -> dict[str, Any]:
        rate = self.acceptance_rate
        return {
            "draft_model": self.draft_model,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": None if rate is None else round(rate, 4),
            "off_reason": self.off_reason,
        }

    @classmethod
    def from_json(cls, d: Any) -> SpeculativeStatus | None:
        if not isinstance(d, Mapping) or not isinstance(d.get("draft_model"), str):
            return None
        reason = d.get("off_reason")
        return cls(
            draft_model=d["draft_model"],
            drafted=int(d.get("drafted") or 0),
            accepted=int(d.get("accepted") or 0),
            off_reason=reason if isinstance(reason, str) else None,
        )
