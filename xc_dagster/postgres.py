"""PostgreSQL URLs of the stores (Dagster's instance, MLflow's tracking store): checks, a printable form without the
password, and a database-wide lock that serializes the first use of a store by processes of every host; and which
URLs name a SQLite store.

Write URLs with the driver, ``postgresql+psycopg2://user:password@host:port/db`` (what ``deploy/postgres.sh``
prints): SQLAlchemy 2.1 reads a bare ``postgresql://`` as the psycopg 3 driver, which the ``postgres`` extra does
not install (docs/configuration.md, Postgres stores).
"""

from __future__ import annotations

import contextlib
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

import sqlalchemy
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from xc_dagster.errors import XCConfigError, XCError

SCHEME = "postgresql"


def is_postgres_uri(uri: str) -> bool:
    """``postgresql://`` or ``postgresql+<driver>://``."""
    return urlsplit(uri).scheme.split("+")[0] == SCHEME


def is_sqlite_uri(uri: str) -> bool:
    """``sqlite://`` or ``sqlite+<driver>://``."""
    return urlsplit(uri).scheme.split("+")[0] == "sqlite"


def redact(uri: str) -> str:
    """The URL without its password (safe to print or to write down): ``postgresql+psycopg2://mlflow@host:5432/db``."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = f"{parts.username}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def check_url(variable: str, uri: str) -> None:
    """A usable PostgreSQL URL: parses, names PostgreSQL, and its driver is installed; else XCConfigError naming
    ``variable`` and what was expected."""
    expected = "postgresql+psycopg2://USER:PASSWORD@HOST:PORT/DATABASE (deploy/postgres.sh prints them)"
    if not is_postgres_uri(uri):
        raise XCConfigError(f"{variable}: expected a PostgreSQL URL {expected}, got {redact(uri)!r}")
    try:
        dialect = sqlalchemy.engine.make_url(uri).get_dialect()
        dialect.import_dbapi()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise XCConfigError(f"{variable}: expected {expected}, got {redact(uri)!r} ({exc})") from None
    except ImportError as exc:
        raise XCConfigError(f"{variable}: the database driver of {redact(uri)!r} is not installed ({exc}): write "
                            f"{expected} and install the postgres extra (pip install 'xc-dagster[postgres]')"
                            ) from None


@contextlib.contextmanager
def advisory_lock(variable: str, uri: str, key: int) -> Iterator[None]:
    """Hold PostgreSQL's advisory lock ``key`` in the database of ``uri`` for the block, on a connection of its own:
    every process that takes it, on any host, waits for the holder. Released when the block ends or the process
    dies (the connection closes). XCError naming ``variable`` when the database cannot be reached."""
    check_url(variable, uri)
    engine = sqlalchemy.create_engine(uri, poolclass=NullPool)  # close() ends the connection and its lock
    conn = None
    try:
        try:
            conn = engine.connect()
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": key})
        except SQLAlchemyError as exc:
            reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
            raise XCError(f"{variable}: cannot connect to {redact(uri)}: {reason}") from None
        yield
    finally:
        if conn is not None:
            conn.close()
        engine.dispose()
