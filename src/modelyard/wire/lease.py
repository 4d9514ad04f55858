"""The lease channel's constants, known to both ends (the protocol: engine/lease_channel.py)."""

from __future__ import annotations

MAX_LINE_BYTES = 1 << 20
PROTOCOL = 1  # carried in the hello both ends exchange first
HELLO_TIMEOUT_S = 5.0  # a connection silent this long before its hello is closed
# How the front hands an engine process its secret: the environment is readable only by the same
# user (/proc/PID/environ), while the command line is readable by everyone (/proc/PID/cmdline).
SECRET_ENV = "MODELYARD_ENGINE_SECRET"
