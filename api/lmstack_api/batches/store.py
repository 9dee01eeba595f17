"""The Batch API's state in `server.batch_dir`: `index.sqlite` and `files/<id>.jsonl`.

The index holds files, batches and one row per finished line of a running batch (its output or
error line, whole). A line is done exactly when its row is committed, so a server killed at any
point redoes only the lines whose rows never landed, and finishes none twice. Files are written
to a temporary name, fsynced and renamed, and only then entered in the index; a file on disk that
the index does not name (a crash between the two) is removed when the store opens again.

SQLite runs in WAL mode with `synchronous=FULL`: a committed row survives the process being
killed and the machine losing power. One connection, guarded by a lock: callers on the event
loop run these methods through `run`, on the store's own thread, as each commit waits for the
disk. Not the loop's default executor: a batch's commits queued there delayed the interactive
requests' tokenization, which shares it (P99 TTFT 3.3x of interactive traffic alone).
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from lmstack.errors import LmstackError

T = TypeVar("T")

# A batch in one of these still has work for the runner.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TIMESTAMPS = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY,
    id TEXT UNIQUE NOT NULL,
    tenant TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY,
    id TEXT UNIQUE NOT NULL,
    tenant TEXT NOT NULL,
    key_hash TEXT,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT,
    status TEXT NOT NULL,
    errors TEXT,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    output_file_id TEXT,
    error_file_id TEXT,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER
);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    ok INTEGER NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)
);
"""


def write_atomic(path: Path, data: bytes) -> None:
    """`data` at `path` whole or not at all: a temporary file, fsynced, renamed over it, and the
    folder fsynced so the rename itself survives a power loss."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BatchStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        self.files_dir = self.root / "files"
        try:
            self.files_dir.mkdir(parents=True, exist_ok=True)
            # One server per folder: two would run the same batches twice. The kernel drops the
            # lock with the process, however it ends.
            self._lock_file = open(self.root / "lock", "a")  # noqa: SIM115 - held for the store's life
        except OSError as exc:
            raise LmstackError(f"server.batch_dir {str(self.root)!r} is not usable: {exc}") from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise LmstackError(
                f"server.batch_dir {str(self.root)!r} is in use by another server; give each its own"
            ) from None
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-store")
        self._db = sqlite3.connect(self.root / "index.sqlite", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._remove_orphans()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` (a store method, a file read) on the store's thread."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        with self._lock:
            self._db.close()
        self._lock_file.close()

    def _remove_orphans(self) -> None:
        known = {r["id"] for r in self._db.execute("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name.endswith(".tmp") or path.stem not in known:
                path.unlink(missing_ok=True)

    def _tx(self):
        return _Transaction(self._db)

    # --- files ---------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def add_file(self, tenant: str, purpose: str, filename: str, data: bytes) -> dict[str, Any]:
        file_id = f"file-{uuid.uuid4().hex}"
        write_atomic(self.file_path(file_id), data)
        row = (file_id, tenant, purpose, filename, len(data), int(time.time()))
        with self._lock:
            self._db.execute(
                "INSERT INTO files (id, tenant, purpose, filename, bytes, created_at) VALUES (?,?,?,?,?,?)",
                row,
            )
        return self.get_file(tenant, file_id)  # type: ignore[return-value]

    def get_file(self, tenant: str | None, file_id: str) -> dict[str, Any] | None:
        """The file's row; None when it does not exist or belongs to another tenant (None: any)."""
        with self._lock:
            row = self._db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None or (tenant is not None and row["tenant"] != tenant):
            return None
        return dict(row)

    def list_files(
        self, tenant: str, purpose: str | None, limit: int, after: str | None
    ) -> tuple[list[dict[str, Any]], bool]:
        """A tenant's files, newest first, after the file `after` (its id); (page, more left)."""
        return self._page("files", tenant, limit, after, ("purpose", purpose) if purpose else None)

    def delete_file(self, tenant: str, file_id: str) -> bool:
        with self._lock, self._tx():
            gone = self._db.execute(
                "DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)
            ).rowcount
        if gone:
            self.file_path(file_id).unlink(missing_ok=True)
        return bool(gone)

    def batch_using(self, file_id: str) -> str | None:
        """An unfinished batch reading `file_id`, if any (such a file is not deleted)."""
        marks = ",".join("?" * len(ACTIVE))
        with self._lock:
            row = self._db.execute(
                f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({marks})", (file_id, *ACTIVE)
            ).fetchone()
        return row["id"] if row else None

    # --- batches -------------------------------------------------------------------------------

    def create_batch(
        self,
        tenant: str,
        key_hash: str | None,
        endpoint: str,
        input_file_id: str,
        completion_window_s: int,
        completion_window: str,
        metadata: dict[str, str] | None,
    ) -> dict[str, Any]:
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = int(time.time())
        with self._lock:
            self._db.execute(
                "INSERT INTO batches (id, tenant, key_hash, endpoint, input_file_id, completion_window, "
                "metadata, status, created_at, expires_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    batch_id,
                    tenant,
                    key_hash,
                    endpoint,
                    input_file_id,
                    completion_window,
                    json.dumps(metadata) if metadata is not None else None,
                    "validating",
                    now,
                    now + completion_window_s,
                ),
            )
        return self.get_batch(tenant, batch_id)  # type: ignore[return-value]

    def get_batch(self, tenant: str | None, batch_id: str) -> dict[str, Any] | None:
        """The batch's row with live request counts; None when it does not exist or belongs to
        another tenant (tenant None: any)."""
        with self._lock:
            row = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or (tenant is not None and row["tenant"] != tenant):
                return None
            out = dict(row)
            if out["status"] in ACTIVE:  # finished lines are still rows, not yet files
                out["completed"], out["failed"] = self._counts(batch_id)
        return out

    def status(self, batch_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row["status"] if row else None

    def _counts(self, batch_id: str) -> tuple[int, int]:
        counts = dict(
            self._db.execute("SELECT ok, COUNT(*) FROM results WHERE batch_id = ? GROUP BY ok", (batch_id,))
        )
        return counts.get(1, 0), counts.get(0, 0)

    def list_batches(self, tenant: str, limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool]:
        rows, more = self._page("batches", tenant, limit, after, None)
        return [self.get_batch(tenant, r["id"]) or r for r in rows], more

    def _page(
        self, table: str, tenant: str, limit: int, after: str | None, where: tuple[str, str] | None
    ) -> tuple[list[dict[str, Any]], bool]:
        sql, args = f"SELECT * FROM {table} WHERE tenant = ?", [tenant]
        if where is not None:
            sql += f" AND {where[0]} = ?"
            args.append(where[1])
        with self._lock:
            if after is not None:
                mark = self._db.execute(
                    f"SELECT seq FROM {table} WHERE id = ? AND tenant = ?", (after, tenant)
                ).fetchone()
                if mark is not None:
                    sql += " AND seq < ?"
                    args.append(mark["seq"])
            rows = self._db.execute(sql + " ORDER BY seq DESC LIMIT ?", (*args, limit + 1)).fetchall()
        return [dict(r) for r in rows[:limit]], len(rows) > limit

    def active_batches(self) -> list[tuple[str, str]]:
        """(id, tenant) of the batches with work left, oldest first."""
        marks = ",".join("?" * len(ACTIVE))
        with self._lock:
            rows = self._db.execute(
                f"SELECT id, tenant FROM batches WHERE status IN ({marks}) ORDER BY seq", ACTIVE
            )
            return [(r["id"], r["tenant"]) for r in rows]

    def set_status(self, batch_id: str, status: str, *, when: tuple[str, ...], **fields: Any) -> bool:
        """Move the batch to `status` (stamping `<status>_at`) if its status is one of `when`."""
        fields = {**fields, "status": status}
        if f"{status}_at" in TIMESTAMPS:
            fields[f"{status}_at"] = int(time.time())
        sets = ", ".join(f"{k} = ?" for k in fields)
        marks = ",".join("?" * len(when))
        with self._lock:
            cur = self._db.execute(
                f"UPDATE batches SET {sets} WHERE id = ? AND status IN ({marks})",
                (*fields.values(), batch_id, *when),
            )
        return cur.rowcount == 1

    # --- lines ---------------------------------------------------------------------------------

    def done_lines(self, batch_id: str) -> set[int]:
        with self._lock:
            return {
                r[0] for r in self._db.execute("SELECT line FROM results WHERE batch_id = ?", (batch_id,))
            }

    def record(self, batch_id: str, rows: list[tuple[int, bool, dict[str, Any]]]) -> None:
        """Finished lines, (line number, ok, output or error line), committed together. A line
        already recorded keeps its first record."""
        with self._lock, self._tx():
            self._db.executemany(
                "INSERT OR IGNORE INTO results (batch_id, line, ok, record) VALUES (?,?,?,?)",
                [(batch_id, line, int(ok), json.dumps(rec)) for line, ok, rec in rows],
            )

    def finalize(self, batch_id: str, status: str) -> None:
        """Write the output and error files from the finished lines (in input order), then, in
        one transaction, enter them, set the counts and `status`, and drop the line rows."""
        with self._lock:
            batch = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            rows = self._db.execute(
                "SELECT ok, record FROM results WHERE batch_id = ? ORDER BY line", (batch_id,)
            ).fetchall()
        tenant, now = batch["tenant"], int(time.time())
        parts = {
            True: [r["record"] for r in rows if r["ok"]],
            False: [r["record"] for r in rows if not r["ok"]],
        }
        made: dict[bool, tuple[str, int] | None] = {True: None, False: None}
        for ok, lines in parts.items():
            if ok or lines:  # always an output file; an error file only when a line failed
                data = "".join(line + "\n" for line in lines).encode()
                file_id = f"file-{uuid.uuid4().hex}"
                write_atomic(self.file_path(file_id), data)
                made[ok] = (file_id, len(data))
        with self._lock, self._tx():
            for ok, made_file in made.items():
                if made_file is not None:
                    name = f"{batch_id}_{'output' if ok else 'error'}.jsonl"
                    self._db.execute(
                        "INSERT INTO files (id, tenant, purpose, filename, bytes, created_at) VALUES (?,?,?,?,?,?)",
                        (made_file[0], tenant, "batch_output", name, made_file[1], now),
                    )
            self._db.execute(
                f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, error_file_id = ?, "
                "completed = ?, failed = ? WHERE id = ?",
                (
                    status,
                    now,
                    made[True][0] if made[True] else None,
                    made[False][0] if made[False] else None,
                    len(parts[True]),
                    len(parts[False]),
                    batch_id,
                ),
            )
            self._db.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an exception); the connection is in autocommit."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, *rest: object) -> None:
        self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")
