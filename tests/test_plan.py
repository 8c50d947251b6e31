"""The rank plan: roles, MemoryX ownership balanced by bytes, the SwarmX tree, and `wse compile`."""
import json
import subprocess
import sys
import warnings

import pytest
import yaml

from mpi_launch.plan import PlanError, make_plan, partition_by_bytes
from test_params import BASE


@pytest.mark.parametrize("sizes,parts,want", [
    ([10, 5, 5, 5, 5, 10], 3, [0, 0, 1, 1, 1, 2]),
    ([1, 1, 1, 100], 4, [0, 1, 2, 3]),
    ([100, 1, 1, 1], 2, [0, 1, 1, 1]),
    ([3, 3, 3, 3], 1, [0, 0, 0, 0]),
])
def test_partition_is_contiguous_and_balanced(sizes, parts, want):
    assert partition_by_bytes(sizes, parts) == want


def test_partition_needs_a_unit_per_server():
    with pytest.raises(PlanError, match="runconfig.num_wgt_servers: 5 MemoryX servers for 4 streaming units"):
        partition_by_bytes([1, 2, 3, 4], 5)


@pytest.mark.parametrize("num_csx,fanout,nodes", [(1, 2, 1), (2, 2, 1), (4, 2, 3), (8, 2, 7), (8, 4, 3), (5, 2, 6)])
def test_swarmx_tree(num_csx, fanout, nodes):
    plan = make_plan(num_csx=num_csx, num_wgt_servers=2, num_workers_per_csx=2, swarmx_fanout=fanout,
                     unit_bytes=[4, 4, 4])
    assert len(plan.swarmx) == nodes and plan.parent[plan.swarmx_root] is None
    roles = [plan.role_of(r)[0] for r in range(plan.world_size)]
    assert roles.count("csx") == num_csx and roles.count("worker") == 2 * num_csx and roles[0] == "coordinator"
    # Every CS-2 reaches the root, and the leaves in tree order are the CS-2s in order (the sum order).
    def leaves(rank):
        return [rank] if rank in plan.csx else [x for k in plan.children[rank] for x in leaves(k)]
    assert leaves(plan.swarmx_root) == plan.csx
    assert all(len(k) <= fanout for k in plan.children.values())


def test_wse_compile(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(BASE))
    run = lambda *a: subprocess.run([sys.executable, "-m", "pyapi.cli", "compile", str(f), *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    proc = run("--json", "--num_csx", "4", "--set", "train_input.batch_size=16")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["plan"]["world_size"] == 1 + 1 + 3 + 4 + 4 and d["bit_identical_to_reference"]
    assert d["model"]["units"] == ["embedding", "blocks.0", "blocks.1", "head"]
    assert all(int(v) >= 0 for v in d["memory_bytes"].values())
    sim = d["simulated"]
    assert sim["num_csx"] == 4 and sim["step_s"] >= max(sim["compute_s"], sim["stream_s"]) > 0
    assert d["wafer_bytes"]["capacity"] == 750 * 994 * 36 * 1024 and d["wafer_bytes"]["fits"]
    slow = json.loads(run("--json", "--num_csx", "4", "--set", "train_input.batch_size=16",
                          "--set", "runconfig.hardware={io_gbps: 12, memoryx_gbps: 12}").stdout)["simulated"]
    assert slow["stream_s"] == pytest.approx(100 * sim["stream_s"]) and slow["step_s"] > sim["step_s"]
    proc = run()
    assert proc.returncode == 0 and "memoryx" in proc.stdout and "MiB" in proc.stdout
    assert "simulated step, weight streaming (a model of the hardware" in proc.stdout and "wafer memory per CS-2" in proc.stdout
    proc = run("--set", "optimizer.learning_rate=fast")
    assert proc.returncode == 1 and proc.stderr.strip() == (
        "wse compile: error: optimizer.learning_rate: expected a number or a list of schedulers, got 'fast'")


@pytest.mark.parametrize("num_csx,said", [
    (1, ["cluster: 1 CS-2, 1 MemoryX, 1 SwarmX (fan-out 2), 1 input worker per CS-2: 5 MPI ranks",
         "1 micro-batch per step", "(4 units)", " for 1 micro-batch of 8 through 4 stages "]),
    (4, ["cluster: 4 CS-2s, 1 MemoryX, 3 SwarmX (fan-out 2), 2 input workers per CS-2: 17 MPI ranks",
         "2 micro-batches per step"]),
])
def test_wse_compile_counts_agree_with_their_nouns(tmp_path, num_csx, said):
    """"4 CS-2", "1 micro-batches" and "1 input worker(s)" were printed: each count and its noun agree."""
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(BASE))
    argv = ["--num_csx", str(num_csx), "--set", "runconfig.num_workers_per_csx=" + str(1 if num_csx == 1 else 2)]
    if num_csx == 4:
        argv += ["--set", "train_input.batch_size=16", "--set", "train_input.micro_batch_size=2"]
    proc = subprocess.run([sys.executable, "-m", "pyapi.cli", "compile", str(f), *argv], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for part in said:
        assert part in proc.stdout, (part, proc.stdout)


SAME = "bits: the same for any num_csx and micro-batch size (every sum a tree over the batch's samples)"


@pytest.mark.parametrize("overrides,line", [
    ((), SAME),
    (("train_input.batch_size=12", "train_input.micro_batch_size=2", "runconfig.num_csx=1"),
     "bits: the single-process reference's at micro_batch_size 2, and another micro-batch size's differ (its 6 "
     "micro-batches are not halvings of the batch; a power of two of them are)"),
    (("runconfig.num_csx=3", "train_input.batch_size=12"),
     "bits: of this layout alone (the same bits need a power of two of micro-batches per CS-2, and num_csx at most "
     "swarmx_fanout or both powers of two)"),
    (("model.name=fc_mlp", "model.input_size=4", "model.hidden_sizes=[8]", "model.num_classes=3"), SAME),
])
def test_wse_compile_says_what_the_bits_are_the_same_as(overrides, line):
    """The default layout of a language model or an MLP has the bits of the tree over its samples, for any
    num_csx and micro-batch size; each way that can fail is said (docs/design.md section 5, (a); a
    PyTorch model's: test_compiler_cluster.py)."""
    from pyapi.job import Job
    from pyapi.params import apply_overrides, validate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = dict(BASE, model={}) if "model.name=fc_mlp" in overrides else BASE
        report = Job(validate(apply_overrides(raw, list(overrides)))).compile()
    assert line in report.lines(), report.lines()
    assert report.batch_invariant == (line == SAME)


def test_a_run_whose_ranks_this_machine_cannot_hold_is_refused_before_they_start(tmp_path):
    """A batch of 2^20 samples: `auto` took a micro-batch of half of it, and the CS-2 ranks died of a
    MemoryError once started. Their memory (`wse compile`'s per-rank figures) beyond this machine's is
    one line naming the micro-batch, before any rank starts; ranks spread over a hostfile's machines are
    not held to this one's memory."""
    import os

    from data_tools.preprocess import preprocess_text
    from mpi_launch.resolved import check_host_memory, rank_memory, resolve
    from pyapi.params import apply_overrides, validate

    spec = validate(apply_overrides(BASE, ["train_input.batch_size=1048576"]))
    run = resolve(spec)
    need = sum(rank_memory(run).values())
    check_host_memory(run, total=need)
    with pytest.raises(PlanError, match=r"^train_input.micro_batch_size: 524,288 samples a micro-batch: the ranks "
                                        r"would hold [\d,.]+ GB \(rank 3, csx 0: [\d,.]+ GB\), more than this "
                                        r"machine's [\d,.]+ GB; use a smaller micro-batch, or spread the ranks over "
                                        r"several machines with --hostfile$"):
        check_host_memory(run, total=need - 1)
    check_host_memory(run, hostfile=tmp_path / "hosts", total=need - 1)
    if need <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        return  # `wse fit` would run it here: what follows is for a machine it does not fit
    (tmp_path / "a.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    preprocess_text([tmp_path / "a.txt"], tmp_path / "data", 16, progress=False)
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(BASE))
    proc = subprocess.run([sys.executable, "-m", "pyapi.cli", "fit", str(f), "--set", "train_input.batch_size=1048576",
                           "--set", f"train_input.data_dir={tmp_path / 'data'}", "--model_dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.splitlines()[-1].startswith(
        "wse fit: error: train_input.micro_batch_size: 524,288 samples a micro-batch: the ranks would hold "), \
        proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides", [[], ["runconfig.num_csx=1", "runconfig.execution_strategy=pipeline"],
                                       ["runconfig.num_csx=1", "model.hidden_size=4096"]])
def test_the_resolved_run_the_ranks_read_from_run_json_is_the_launchers(overrides):
    """What run.json holds of a resolved run (a streamed one; a pipelined one; one whose pipelined
    placement does not fit, its times NaN) comes back through JSON as the launcher resolved it."""
    from mpi_launch.resolved import ResolvedRun, resolve
    from pyapi.params import apply_overrides, validate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto's choice of micro-batch, said
        run = resolve(validate(apply_overrides(BASE, overrides)))
    d = json.loads(json.dumps(run.to_json(), allow_nan=False))  # strict JSON
    assert d == run.to_json()
    back = ResolvedRun.from_json(d, run.spec, run.model)
    for name in ("plan", "strategy", "why", "batches"):
        assert getattr(back, name) == getattr(run, name), name
    assert back.placement.regions == run.placement.regions
    assert json.dumps(back.placement.to_dict()) == json.dumps(run.placement.to_dict())  # NaN as NaN
