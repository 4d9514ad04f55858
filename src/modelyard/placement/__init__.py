"""Placement, pure: the policy that decides what an engine loads and evicts (placement/policy.py
until the package move), the ledger arithmetic it plans with, and the one builder of its
resident view from the engine's typed status. The engine plans with it; the front predicts the
engine's decision with it, on the same inputs (DESIGN.md §3.11).

Imports only the standard library, `types`, `errors` and `wire` (DESIGN.md §2)."""
