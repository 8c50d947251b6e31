"""The appliance's record of its jobs: one SQLite file in its state directory (docs/design/appliance.md "Jobs").

Every change of a job's state is written here before the service acts on it, so a service that
is killed and started again finds its queue as it was: queued jobs wait in the same order, and
jobs that were running are queued again, in their places (submission order), and resume from their
latest checkpoints.
"""
import json
import sqlite3
import time

from pyapi.errors import ApplianceError
from pyapi.client import JobState

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    uid           INTEGER NOT NULL,
    gid           INTEGER NOT NULL,
    user          TEXT    NOT NULL,
    name          TEXT    NOT NULL,
    kind          TEXT    NOT NULL,   -- "train" or "serve" (requests.JOB_KINDS)
    params        TEXT    NOT NULL,   -- the validated params (JSON): what the runner trains, or serves
    cwd           TEXT    NOT NULL,   -- the submitter's directory: relative data paths resolve here
    umask         INTEGER NOT NULL,   -- the submitter's: the job's files get the modes theirs would
    model_dir     TEXT    NOT NULL,
    num_csx       INTEGER NOT NULL,
    max_steps     INTEGER NOT NULL,
    priority      INTEGER NOT NULL,
    max_restarts  INTEGER NOT NULL,
    state         TEXT    NOT NULL,
    restarts      INTEGER NOT NULL DEFAULT 0,  -- restarts after a fault of the job's own
    attempts      INTEGER NOT NULL DEFAULT 0,  -- runners started: restarts, and starts again after a stop
    overtaken     INTEGER NOT NULL DEFAULT 0,  -- later jobs started while this one waited
    submitted     REAL    NOT NULL,
    started       REAL,
    ended         REAL,
    pid           INTEGER,                     -- the runner of the current attempt
    reason        TEXT,                        -- why it failed or was cancelled; the last fault it survived
    step          INTEGER,                     -- where it ended (model_dir's metrics then: a later job may reuse it)
    loss          REAL,
    sim_seconds   REAL,
    numerics      TEXT                         -- the submitter's numerics variables (JSON); NULL: not sent
)"""

#: Columns added after the table's first version, with what rows of that version get.
_ADDED = {
    "umask": "INTEGER NOT NULL DEFAULT 63",  # 0o077: files for the user alone
    # NULL: the runner gets what the version that queued the job gave it (the service's own).
    "numerics": "TEXT",
    "attempts": "INTEGER NOT NULL DEFAULT 0",
    "kind": "TEXT NOT NULL DEFAULT 'train'",
}
#: What an added column holds for the rows of an earlier version, from what they do hold.
_DERIVED = {"attempts": "restarts + (started IS NOT NULL)",  # at least: starts after a stop were not counted
            # Before version 4, a serve job's params were {"serve": its fields}: the only params with that key.
            "kind": "CASE WHEN json_type(params, '$.serve') = 'object' THEN 'serve' ELSE 'train' END"}
#: The table's version, in SQLite's user_version: 0 for tables made before it was kept (their
#: columns are added, as any earlier version's), 2 with the numerics column, 3 with attempts, 4 with
#: kind (and a serve job's params its fields, no longer wrapped in {"serve": ...}). A
#: newer table is refused: its rows may need what this code does not know (a column it would not fill).
VERSION = 4

_FIELDS = ("id", "uid", "gid", "user", "name", "kind", "params", "cwd", "umask", "model_dir", "num_csx", "max_steps",
           "priority", "max_restarts", "state", "restarts", "attempts", "overtaken", "submitted", "started", "ended",
           "pid", "reason", "step", "loss", "sim_seconds", "numerics")


class Store:
    """The jobs table. Only the service writes it (it holds the state directory's lock)."""

    def __init__(self, path):
        """Open the table at ``path``, adopting one of an earlier version (its columns added), or raise
        ApplianceError in one line naming the file and what to do (a newer version's, or not ours)."""
        self.db = sqlite3.connect(str(path), isolation_level=None)  # autocommit: each update is durable
        self.db.row_factory = sqlite3.Row
        try:
            self._adopt(path)
        except sqlite3.DatabaseError as exc:  # not SQLite, or damaged
            self.db.close()
            raise ApplianceError(f"{path}: not a jobs table this appliance can read ({exc}); move it away "
                                 "or start with another --state_dir") from None
        except ApplianceError:
            self.db.close()
            raise

    def _adopt(self, path):
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > VERSION:
            raise ApplianceError(f"{path}: a jobs table of version {version}, written by a newer wse-cluster "
                                 f"(this one knows up to {VERSION}); start the appliance of that version, or "
                                 "start this one with another --state_dir")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(_SCHEMA)
        columns = {r["name"] for r in self.db.execute("PRAGMA table_info(jobs)")}
        added = [column for column in _ADDED if column not in columns]  # a table made by an earlier version
        for column in added:
            self.db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {_ADDED[column]}")
            columns.add(column)
        odd = sorted(set(_FIELDS) ^ columns)
        if odd:  # a column no version of ours wrote, or one of ours missing: another program's table
            raise ApplianceError(f"{path}: its jobs table {'lacks' if odd[0] in _FIELDS else 'has'} column "
                                 f"{odd[0]!r}, unlike any wse-cluster's; move it away or start with another "
                                 "--state_dir")
        for column in set(added) & set(_DERIVED):
            self.db.execute(f"UPDATE jobs SET {column} = {_DERIVED[column]}")
        if "kind" in added:
            self.db.execute("UPDATE jobs SET params = json_extract(params, '$.serve') WHERE kind = 'serve'")
        self.db.execute(f"PRAGMA user_version = {VERSION}")

    def close(self):
        self.db.close()

    def add(self, **job):
        job = {**job, "params": json.dumps(job["params"]), "state": JobState.QUEUED.value, "submitted": time.time()}
        if job.get("numerics") is not None:
            job["numerics"] = json.dumps(job["numerics"])
        keys = ", ".join(job)
        marks = ", ".join("?" for _ in job)
        return self.db.execute(f"INSERT INTO jobs ({keys}) VALUES ({marks})", tuple(job.values())).lastrowid

    def get(self, job_id):
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def update(self, job_id, **fields):
        """Set ``fields`` of job ``job_id`` (a state as a ``JobState`` or its value)."""
        unknown = set(fields) - set(_FIELDS)
        if unknown:
            raise KeyError(f"jobs table: no column {sorted(unknown)[0]}")
        if "state" in fields:
            fields["state"] = JobState(fields["state"]).value
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*fields.values(), job_id))

    def jobs(self, uid=None, states=None):
        """Jobs in submission order, of one user (``uid``) or all, in ``states`` or any."""
        sql, args = "SELECT * FROM jobs WHERE 1", []
        if uid is not None:
            sql += " AND uid = ?"
            args.append(uid)
        if states is not None:
            sql += f" AND state IN ({', '.join('?' for _ in states)})"
            args += [JobState(s).value for s in states]
        return [_job(r) for r in self.db.execute(sql + " ORDER BY id", args)]

    def queue(self):
        """Queued jobs in the order they are considered: higher priority first, then first come."""
        rows = self.db.execute("SELECT * FROM jobs WHERE state = ? ORDER BY priority DESC, id",
                               (JobState.QUEUED.value,))
        return [_job(r) for r in rows]

    def requeue_running(self, why):
        """Jobs recorded as running belong to a service that is gone: they wait again, ahead of later ones."""
        ids = [r["id"] for r in self.db.execute("SELECT id FROM jobs WHERE state = ?", (JobState.RUNNING.value,))]
        for job_id in ids:
            self.update(job_id, state=JobState.QUEUED, pid=None, reason=why)
        return ids


def _job(row):
    job = dict(row)
    job["params"] = json.loads(job["params"])
    job["state"] = JobState(job["state"])
    if job["numerics"] is not None:
        job["numerics"] = json.loads(job["numerics"])
    return job
