"""The determinism contract (docs/design.md section 5): batch composition, the numerics environment,
and the kernels' parallel loops keeping each thread's variables its own.

The contract's other claims are tested where their machinery is: num_csx in test_cluster.py and
test_modelzoo.py (the reference step's bits on 1, 2, 4 CS-2s), thread counts in test_nn_ops.py,
test_clip.py, test_sparse.py and test_optim.py, resume in test_cluster.py, the appliance in
test_appliance.py.
"""
import re
from pathlib import Path

import numpy as np
import pytest

from mpi_launch.resolved import resolve
from wse_core.models import build_model
from wse_core.nn.gemm import CHUNK_ROWS

FAMILIES = {
    "gpt2": dict(name="gpt2", vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=4,
                 max_position_embeddings=CHUNK_ROWS + 8),
    "llama": dict(name="llama", vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=4,
                  filter_size=48, max_position_embeddings=CHUNK_ROWS + 8,
                  attention_module="multiquery_attention", extra_attention_params={"num_kv_groups": 2}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("seq", [5, CHUNK_ROWS + 3])
def test_a_samples_logits_have_the_same_bits_alone_and_in_any_batch(family, seq):
    """A sample's logits do not depend on the other samples of its micro-batch, nor on how many
    there are, nor on its place among them (BLAS picks kernels by the rows of a call)."""
    model = build_model(FAMILIES[family])
    params = model.init_params(seed=1)
    ids = np.random.default_rng(2).integers(0, 97, (7, seq + 1)).astype(np.int32)

    def logits(rows):
        batch = {"input_ids": ids[rows, :-1].copy(), "labels": ids[rows, 1:].copy(),
                 "loss_mask": np.ones((len(rows), seq), np.int32)}
        return model.forward(params, batch)[0]

    whole = logits(list(range(7)))
    for rows in ([3], [3, 0], [5, 6, 3], [1, 2, 4, 3]):
        assert logits(rows)[rows.index(3)].tobytes() == whole[3].tobytes(), rows


def _checkpointed_run(tmp_path, numerics, **runconfig):
    """A run directory holding a step-2 checkpoint written under ``numerics``, and the run's params."""
    from data_tools.checkpoint import CheckpointWriter
    from pyapi.params import validate

    p = {"train_input": {"data_dir": str(tmp_path / "data"), "batch_size": 4},
         "model": dict(FAMILIES["gpt2"], max_position_embeddings=8),
         "optimizer": {"optimizer_type": "SGD", "learning_rate": 0.1},
         "runconfig": {"max_steps": 4, "model_dir": str(tmp_path / "model"), **runconfig}}
    params = validate(p)
    weights = build_model(params.model).init_params(seed=0)
    writer = CheckpointWriter(tmp_path / "model", 2).prepare()
    writer.commit([writer.write_shard(0, weights)], numerics=numerics)
    return params


def test_a_resume_under_another_blas_kernel_is_refused_in_one_line_unless_allowed(tmp_path):
    """The checkpoint says it was computed with another OpenBLAS kernel: the resume is refused, naming
    the checkpoint, what changed and the setting that allows it; allowed, the run records the change."""
    from mpi_launch.mpiexec import MPILaunchError
    from mpi_launch.rundir import RunDir
    from wse_core.numerics import environment

    here = environment()
    other = dict(here, blas_kernel="Prescott" if here["blas_kernel"] != "Prescott" else "Haswell")
    params = _checkpointed_run(tmp_path, other)
    with pytest.raises(MPILaunchError) as err:
        RunDir(tmp_path / "model").prepare(resolve(params))
    assert str(err.value) == (
        f"{tmp_path / 'model' / 'checkpoint_2'}: written under another numerics environment (BLAS kernel "
        f"{other['blas_kernel']} -> {here['blas_kernel']}): resuming here would not give an uninterrupted run's "
        "bits; set runconfig.allow_numerics_change: true (--set runconfig.allow_numerics_change=true) to resume "
        "anyway")
    allowed = _checkpointed_run(tmp_path / "allowed", other, allow_numerics_change=True)
    run = RunDir(tmp_path / "allowed" / "model").prepare(resolve(allowed))
    assert run["start_step"] == 2 and run["numerics_changed"] == [
        f"BLAS kernel {other['blas_kernel']} -> {here['blas_kernel']}"]
    assert run["numerics"] == here and RunDir(tmp_path / "allowed" / "model").read_run() == run


def test_a_resume_in_the_same_numerics_environment_or_from_an_unrecorded_one_goes_on(tmp_path):
    """Same environment (thread counts aside: they change no bits), or a checkpoint that recorded none
    (an earlier version's, or one imported from Hugging Face): nothing is known to differ."""
    from mpi_launch.rundir import RunDir
    from wse_core.numerics import environment

    same = dict(environment(), blas_threads=64, variables={"OMP_NUM_THREADS": "64"})
    assert RunDir(tmp_path / "model").prepare(resolve(_checkpointed_run(tmp_path, same)))["numerics_changed"] == []
    params = _checkpointed_run(tmp_path / "old", None)
    assert RunDir(tmp_path / "old" / "model").prepare(resolve(params))["start_step"] == 2


def _prange_bodies(source):
    """(line, body) of every ``prange`` loop of a Cython source: the lines indented below it."""
    lines = source.splitlines()
    for i, line in enumerate(lines):
        if "prange(" in line and line.lstrip().startswith("for "):
            indent, body = len(line) - len(line.lstrip()), []
            for nxt in lines[i + 1:]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                body.append(nxt)
            yield i + 1, "\n".join(body)


def test_no_parallel_loop_writes_a_variable_only_through_its_address():
    """Cython makes a variable of a ``prange`` body private to each thread only when the body assigns
    it; one written only through its address (``f(&a)``, ``memcpy(&bits, ...)``) is shared by the
    threads, a race whose bits change from run to run (a LayerNorm backward's row sums and a 16-bit
    rounding's bits once were). Every address a body takes of a plain variable, it also assigns."""
    root = Path(__file__).resolve().parents[1] / "wse_core"
    bad = []
    for path in sorted(root.rglob("*.pyx")):
        for line, body in _prange_bodies(path.read_text()):
            taken = set(re.findall(r"&([A-Za-z_]\w*)\b(?!\s*\[)", body))
            assigned = set(re.findall(r"^\s*([A-Za-z_]\w*)\s*[-+*/|&^]?=(?!=)", body, re.M))
            bad += [f"{path.relative_to(root.parent)}:{line}: {name}" for name in sorted(taken - assigned)]
    assert not bad, "written through its address in a prange body, so shared by its threads: " + ", ".join(bad)
