"""``Job``: configure, compile and run a training job from Python, as ``wse fit`` does.

    from pyapi import Job
    job = Job.from_yaml("params.yaml", num_csx=2)
    job.compile()            # the rank plan and memory estimate, nothing launched
    result = job.fit()       # starts mpiexec underneath; works from a script or a notebook
    result.metrics[-1]["loss"]
"""
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pyapi import params as params_mod


class JobError(RuntimeError):
    """A training job failed; the message is one line naming the rank, its role and what happened."""


@dataclass
class FitResult:
    model_dir: Path
    metrics: list = field(default_factory=list)


class Job:
    """A validated training job."""

    def __init__(self, params):
        self.params = params

    @classmethod
    def from_yaml(cls, path, *, num_csx=None, model_dir=None, overrides=None):
        overrides = list(overrides or [])
        if num_csx is not None:
            overrides.append(f"runconfig.num_csx={num_csx}")
        if model_dir is not None:
            overrides.append(f"runconfig.model_dir={json.dumps(str(model_dir))}")
        return cls(params_mod.load(path, overrides))

    @property
    def model_dir(self):
        return Path(self.params["runconfig"]["model_dir"])

    def compile(self):
        from mpi_launch.plan import describe

        return describe(self.params)

    def command(self, hostfile=None):
        from mpi_launch.launcher import fit_command

        return fit_command(self.params, hostfile=hostfile)[0]

    def fit(self, *, checkpoint_path=None, hostfile=None, stream=sys.stdout):
        """Train; raise JobError with one line if any rank fails."""
        from mpi_launch.launcher import fit_command, launch, prepare_run

        self._check_data()
        prepare_run(self.params, checkpoint=checkpoint_path)
        cmd, plan = fit_command(self.params, hostfile=hostfile)
        code, failure = launch(cmd, plan, self.model_dir, stream=stream, watch=hostfile is None)
        if code != 0:
            raise JobError(failure)
        metrics = [json.loads(line) for line in (self.model_dir / "metrics.jsonl").read_text().splitlines()]
        return FitResult(self.model_dir, metrics)

    def _check_data(self):
        """Fail before mpiexec starts if the training data cannot feed the model."""
        from data_tools.dataset import Dataset

        t = self.params["train_input"]
        ds = Dataset(t["data_dir"])
        m = self.params["model"]
        if m["name"] == "gpt2":
            if ds.format != "lm":
                raise params_mod.ParamsError(f"train_input.data_dir: {t['data_dir']} is an array dataset; gpt2 needs LM data")
            seq = ds.example_shape[-1]
            if seq > m["max_position_embeddings"]:
                raise params_mod.ParamsError(f"model.max_position_embeddings: {m['max_position_embeddings']} is shorter "
                                             f"than the data's max_seq_length {seq}")
            vocab = ds.params.get("vocab_size")
            if vocab is not None and vocab > m["vocab_size"]:
                raise params_mod.ParamsError(f"model.vocab_size: {m['vocab_size']} is smaller than the data's "
                                             f"vocabulary {vocab}")
        elif ds.format != "arrays":
            raise params_mod.ParamsError(f"train_input.data_dir: {t['data_dir']} is LM data; fc_mlp needs an array dataset")
