"""A private PostgreSQL server for tests: Debian's binaries (scripts/provide-postgres.sh), a data
directory in a fresh temp dir, listening on 127.0.0.1 at a free port, stopped and removed at the
end. Not a fake of PostgreSQL: the real server, only private to the test session.

PostgreSQL refuses to run as root (CI runs as root): the server then runs as the `postgres`
account (or $MODELYARD_POSTGRES_USER), which owns the temp dir.

API (tests/conftest.py wraps it in fixtures):
  server = PostgresServer.start()            # or PostgresServer.available() is None first
  url = server.create_database("name")       # "postgresql+psycopg://…/name", a fresh database
  server.stop()
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import importlib.util
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support import free_port

SUPERUSER = "modelyard"
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def bin_dir() -> Path | None:
    """Where initdb and postgres are: $MODELYARD_POSTGRES_BIN, else Debian's newest version."""
    if env := os.environ.get("MODELYARD_POSTGRES_BIN"):
        return Path(env) if (Path(env) / "initdb").exists() else None
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parent.parent.name)
                   if Path(p).parent.parent.name.isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _run_as() -> pwd.struct_passwd | None:
    """The account the server runs as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    return pwd.getpwnam(os.environ.get("MODELYARD_POSTGRES_USER", "postgres"))


class PostgresServer:
    def __init__(self, bins: Path, root: Path, port: int, proc: subprocess.Popen[bytes]) -> None:
        self.bins = bins
        self.root = root
        self.port = port
        self.proc = proc
        self._databases = 0

    @staticmethod
    def unavailable() -> str | None:
        """Why no server can be started here (None: it can)."""
        if bin_dir() is None:
            return "PostgreSQL is not installed (run `make postgres`)"
        if importlib.util.find_spec("psycopg") is None:  # the driver the URLs name
            return "psycopg is not installed (pip install -e '.[dev]')"
        if os.geteuid() == 0:
            try:
                _run_as()
            except KeyError:
                return "running as root and there is no `postgres` account to run PostgreSQL as"
        return None

    @classmethod
    def start(cls, timeout_s: float = 30.0) -> PostgresServer:
        bins = bin_dir()
        assert bins is not None, "PostgreSQL is not installed"
        account = _run_as()
        root = Path(tempfile.mkdtemp(prefix="modelyard-pg-"))
        kwargs: dict[str, Any] = {}
        if account is not None:
            os.chown(root, account.pw_uid, account.pw_gid)
            kwargs = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        data, log = root / "data", root / "server.log"
        subprocess.run(
            [str(bins / "initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust",
             "--encoding=UTF8", "--no-sync"],
            check=True, capture_output=True, cwd=root, **kwargs,
        )
        port = free_port()
        with log.open("wb") as out:
            if account is not None:
                os.chown(log, account.pw_uid, account.pw_gid)
            proc = subprocess.Popen(
                [str(bins / "postgres"), "-D", str(data), "-p", str(port),
                 "-h", "127.0.0.1", "-k", str(root),
                 # a test server: durability buys nothing, speed does
                 "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off", "-c", "max_connections=200"],
                stdout=out, stderr=subprocess.STDOUT, cwd=root, start_new_session=True,
                **kwargs,
            )
        server = cls(bins, root, port, proc)
        server._wait_ready(timeout_s)
        return server

    def _wait_ready(self, timeout_s: float) -> None:
        import psycopg

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited: {self.log()}")
            try:
                psycopg.connect(self.dsn("postgres"), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"postgres not ready: {self.log()}") from None
                time.sleep(0.05)

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.root / "server.log").read_text(errors="replace")[-4000:]
        return ""

    def dsn(self, database: str) -> str:
        return f"host=127.0.0.1 port={self.port} user={SUPERUSER} dbname={database}"

    def url(self, database: str) -> str:
        """The SQLAlchemy URL modelyard's `database_url` takes."""
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """A new, empty database; its URL."""
        import psycopg

        self._databases += 1
        name = (name or f"t{self._databases}").lower()
        name = re.sub(r"[^a-z0-9_]", "_", name)[:50] + f"_{self._databases}"
        assert _NAME.match(name), name
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: PostgreSQL's fast shutdown
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # The data dir goes when the test process exits: removing thousands of files here
        # would count against the last test's timeout.
        atexit.register(shutil.rmtree, self.root, ignore_errors=True)
