"""A job's states: ``queued -> running -> done | failed | cancelled`` (``running -> queued`` when the
service stops, and at its next start for jobs a killed service was running). docs/design/appliance.md "Jobs".

The states travel as their values: in the jobs table's ``state`` column and in every reply.
"""
import enum


class JobState(str, enum.Enum):
    QUEUED = "queued"        # waiting for its CS-2s (or for the service to start again)
    RUNNING = "running"      # an attempt's runner is alive (a restart stays running)
    DONE = "done"
    FAILED = "failed"        # its own input, or a fault after its restarts; its reason says which
    CANCELLED = "cancelled"

    def __str__(self):  # the value, in messages and f-strings (not "JobState.DONE")
        return self.value

    def __format__(self, spec):
        return format(self.value, spec)

    def is_terminal(self):
        """Ended: nothing more happens to the job."""
        return self in ENDED


#: Holding or waiting for CS-2s: two of one user's active jobs may not share a model_dir.
ACTIVE = (JobState.QUEUED, JobState.RUNNING)
ENDED = (JobState.DONE, JobState.FAILED, JobState.CANCELLED)
