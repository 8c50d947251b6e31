"""``cstorch.distributed``: the cluster's settings (``ClusterConfig``) and the streamer API that input
functions call.

On the appliance the input function runs twice over: once on the user node, where the step is
traced on the global batch (``is_streamer()`` False, ``get_streaming_batch_size(B)`` is B), and
once in each input worker, a *streamer*, which feeds its CS-2 that CS-2's share of every batch
(``get_streaming_batch_size(B)`` is the share, ``get_streaming_rank()`` its rank among the
``num_streamers()``, the CS-2s' workers in CS-2 order). Here the DataExecutor plays both in this
process (``pyapi.cstorch.utils.data``): it makes the loader once as the user node and, when that
call asked anything of the streamer API, once more per streamer, with the streamer's answers in
force, and deals the streamers' batches to the CS-2s as the appliance does (docs/user-guide.md,
"Your own PyTorch model"). A loader that asks nothing is one global stream, the same for any
number of CS-2s.
"""
import contextlib
import threading
from dataclasses import dataclass, field

from pyapi.cstorch.errors import not_built, refusing
from wse_core.errors import ConfigError

# Fields of Cerebras' ClusterConfig that locate or size a real cluster's services; the emulated
# cluster is this machine's ranks, so they are accepted and said to mean nothing here.
_MEANINGLESS = ("mgmt_address", "mgmt_namespace", "credentials_path", "job_labels", "job_priority",
                "job_time_sec", "mount_dirs", "python_paths", "disable_version_check", "max_act_per_csx",
                "workflow_id", "automount", "transfer_processes", "debug_args", "precision_opt_level")


@dataclass
class ClusterConfig:
    """Cerebras' cluster settings (``cstorch.distributed.ClusterConfig``, 2.3 on). ``num_csx``,
    ``max_wgt_servers`` (MemoryX ranks, at most: the plan may use fewer) and ``num_workers_per_csx``
    (input workers a CS-2; 0: one) size the emulated cluster; the others are accepted and, once a
    backend takes them, named in one line as meaning nothing here."""

    mgmt_address: str = None
    mgmt_namespace: str = None
    credentials_path: str = None
    num_csx: int = 1
    max_wgt_servers: int = 1
    max_act_per_csx: int = None
    num_workers_per_csx: int = 0
    job_labels: list = field(default_factory=list)
    job_priority: str = None
    job_time_sec: int = None
    mount_dirs: list = field(default_factory=list)
    python_paths: list = field(default_factory=list)
    disable_version_check: bool = False
    workflow_id: str = None
    automount: bool = True

    def ignored(self):
        """The fields set to other than their defaults that mean nothing on the emulated cluster."""
        default = type(self)()
        return [name for name in _MEANINGLESS if getattr(self, name, None) != getattr(default, name, None)]

    @property
    def workers(self):
        return max(1, self.num_workers_per_csx or 1)


@dataclass
class CSConfig(ClusterConfig):
    """Cerebras' 2.0-era cluster settings (``cstorch.utils.CSConfig``), given to
    ``DataExecutor(cs_config=...)``: a ClusterConfig with the fields it had beside
    (``transfer_processes``, ``debug_args``, ``precision_opt_level``), taken."""

    transfer_processes: int = None
    debug_args: object = None
    precision_opt_level: int = None


class _Streaming(threading.local):
    """Who is asking: the user node (``rank`` None) or streamer ``rank`` of ``count``, whose CS-2 takes
    ``share`` samples of every batch; ``asked``: the streamer API was called."""

    def __init__(self):
        self.rank, self.count, self.share, self.asked = None, 0, None, False


_streaming = _Streaming()


@contextlib.contextmanager
def streamer(rank, count, share):
    """The streamer API answering as streamer ``rank`` of ``count``, whose CS-2 takes ``share``
    samples of every batch (the DataExecutor makes a loader under it)."""
    saved = _streaming.rank, _streaming.count, _streaming.share
    _streaming.rank, _streaming.count, _streaming.share = rank, count, share
    try:
        yield
    finally:
        _streaming.rank, _streaming.count, _streaming.share = saved


@contextlib.contextmanager
def watching():
    """Yields a function telling whether the streamer API was called within the block."""
    before, _streaming.asked = _streaming.asked, False
    try:
        yield lambda: _streaming.asked
    finally:
        _streaming.asked = before or _streaming.asked


def is_streamer():
    """Whether this code runs as a streamer (an input worker making its CS-2's share), not the user node."""
    _streaming.asked = True
    return _streaming.rank is not None


def get_streaming_rank():
    """This streamer's rank among the streamers (the CS-2s' input workers, in CS-2 order)."""
    _streaming.asked = True
    if _streaming.rank is None:
        raise RuntimeError("cstorch.distributed.get_streaming_rank(): not a streamer (ask is_streamer() first: the "
                           "user node traces the step on the whole batch)")
    return _streaming.rank


def num_streamers():
    """How many streamers feed the cluster: num_csx x num_workers_per_csx, asked by a streamer (0 on the
    user node, as on the appliance)."""
    _streaming.asked = True
    return _streaming.count


def get_streaming_batch_size(effective_batch_size, global_rank=None):
    """The samples of a batch this task streams: on a streamer its CS-2's share of the global batch (the
    user node's batch size B; the first B mod num_csx CS-2s take one more), on the user node
    ``effective_batch_size`` itself."""
    _streaming.asked = True
    if global_rank is not None:
        raise not_built("get_streaming_batch_size(global_rank=...)", "the calling streamer's own batch size")
    if isinstance(effective_batch_size, bool) or not isinstance(effective_batch_size, int) \
            or effective_batch_size < 1:
        raise ConfigError(f"get_streaming_batch_size: expected a batch size >= 1, got {effective_batch_size!r}")
    return effective_batch_size if _streaming.rank is None else _streaming.share


def is_master_ordinal(local=False):
    """True on the user node, which runs the script's loop."""
    return _streaming.rank is None


def get_ordinal():
    """0 on the user node; a streamer's ordinal is its rank plus one."""
    return 0 if _streaming.rank is None else _streaming.rank + 1


__getattr__ = refusing("cstorch.distributed", "built: ClusterConfig, is_streamer, get_streaming_rank, num_streamers, "
                      "get_streaming_batch_size, is_master_ordinal, get_ordinal")
