"""Child processes: spawning, readiness, escalating teardown, their log files (used by the
engine for backends and by the front's local engine provider for engines)."""
