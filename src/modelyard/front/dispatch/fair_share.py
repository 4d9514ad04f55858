"""The fair share's weights: whose request weighs how much in a model's queue. The tags that
order the queue (start-time fair queuing, shared with the engine's slot queue) are in
placement/fair_tags.py."""

from __future__ import annotations

from modelyard.config import FairShareSettings
from modelyard.front.identity.principal import Principal
from modelyard.placement.fair_tags import COST, FairTags, Tag

__all__ = ["COST", "FairTags", "Tag", "weight_of"]


def weight_of(settings: FairShareSettings, principal: Principal | None) -> float:
    """The owner's weight: its user name's entry, else its group's (`group:<name>`), else
    `default_weight`. Anonymous callers (one owner together) have the default."""
    weights = settings.weights
    user = None if principal is None else principal.user
    group = None if principal is None else principal.group
    if user is not None and user in weights:
        return weights[user]
    if group is not None and f"group:{group}" in weights:
        return weights[f"group:{group}"]
    return settings.default_weight
