"""The simulated time held against real CS-2 and CS-3 training runs: published samples/s next to the walk's.

    wse bench fidelity [--json PATH]

Every row is a logged run that names its model, batch and system count (ALCF's user guides and
training material print the log lines of Model Zoo's configs on their CS-2s, later CS-3s; EPCC's
workshop material one fine-tuning run). The walk (``wse_core.perf.step.walk_step``) times the same
model, global batch, sequence, precision and system, the micro-batch as logged or, when the log
does not say, as ``micro_batch_size: auto`` takes it (the largest that fits the wafer). Nothing
here is fitted: every row checks the model. Rows of an earlier software release on the same
hardware are kept to show what the release alone moved (GPT-J 6B on two CS-2s: 27.5 samples/s
with release 1.7.1, 34.0 with 1.8.0, 43.7 with 2.0.3); the summary counts the rows of the release
each system was last logged with. Shapes come from Model Zoo's config at the run's release; a field
the log does not give is marked where it is inferred.
"""
from dataclasses import asdict, dataclass

from bench.harness import table

UG = "argonne-lcf/user-guides docs/ai-testbed/cerebras/example-programs.md"
ASTS = "argonne-lcf/ai-science-training-series 07_AITestbeds/Cerebras"


@dataclass(frozen=True)
class Run:
    """A published training run and what it takes to time it."""
    id: str
    system: str          # cs2 | cs3
    num_csx: int
    model: str           # a key of SHAPES
    seq: int
    batch: int           # global batch
    micro_batch: object  # as logged, or None (not logged: the walk takes micro_batch_size: auto)
    release: str
    published: float     # samples/s
    source: str
    latest: bool         # the last release this system was logged with
    note: str = ""


#: Model Zoo's shapes of the published models. GPT-J's rotary positions and parallel attention
#: change none of its GEMMs; it is timed as a gpt3-family decoder of its sizes.
SHAPES = {
    "GPT-J 6B": {"name": "gpt3", "hidden_size": 4096, "num_hidden_layers": 28, "num_heads": 16,
                 "filter_size": 16384, "vocab_size": 50400},
    "GPT-2 124M": {"name": "gpt2", "hidden_size": 768, "num_hidden_layers": 12, "num_heads": 12,
                   "filter_size": 3072, "vocab_size": 50257},
    "LLaMA 7B": {"name": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_heads": 32,
                 "filter_size": 11008, "vocab_size": 32000},
    "Llama-3 8B": {"name": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_heads": 32,
                   "filter_size": 14336, "vocab_size": 128256, "attention_module": "multiquery_attention",
                   "extra_attention_params": {"num_kv_groups": 8}},
}

RUNS = [
    Run("A1", "cs2", 2, "GPT-J 6B", 2048, 130, None, "1.7.1", 27.53, f"{UG} @c17ccbc3f4e1 (2023-03)", False,
        "65 per CS-2 (batch was per system before 1.9)"),
    Run("A2", "cs2", 2, "GPT-J 6B", 2048, 130, None, "1.8.0", 33.98, f"{UG} @ba5479692e5d (2023-05)", False,
        "65 per CS-2"),
    Run("A3", "cs2", 1, "GPT-J 6B", 2048, 66, None, "1.9.2", 19.80, f"{ASTS}/gpt-j.md @548f22f1429c (2023-11)", True),
    Run("A4", "cs2", 2, "GPT-J 6B", 2048, 120, None, "2.0.3", 43.67, f"{UG} @a8a674de1338 (2023-11)", True),
    Run("A5", "cs2", 1, "GPT-2 124M", 2048, 112, None, "2.0.3", 494.4, f"{ASTS}/gpt2.md @fc2a8b768d7a (2024-03)", True),
    Run("A6", "cs2", 1, "LLaMA 7B", 2048, 99, 99, "2.1.1", 20.45, f"{UG} @9fa2df7be841 (2024-03)", True,
        "micro-batch 99 logged"),
    Run("A7", "cs3", 1, "GPT-J 6B", 2048, 120, None, "2.5.0", 44.75, f"{UG} @0a3c674778c6 (2025-10)", True),
    Run("A8", "cs3", 1, "LLaMA 7B", 2048, 1024, None, "2.5.0", 31.98, f"{UG} @0a3c674778c6 (2025-10)", True,
        "Llama-2 7B (its shape is LLaMA 7B's); sequence 2048 inferred: the run read the 2048-token data "
        "of the LLaMA run"),
    Run("A9", "cs3", 1, "Llama-3 8B", 2048, 960, None, "2.5.0", 19.4,
        "argonne-lcf/ALCF_Hands_on_HPC_Workshop aiTestbeds/Cerebras/PyTorch/llama3-8b.md @d52173bdfde4 (2025-10)", True,
        "batch inferred from a step of 49.4 s (Model Zoo's Llama-3 8B config: 960); 5 logged steps"),
    Run("E1", "cs2", 1, "LLaMA 7B", 1024, 8, None, "2.10.0", 17.8,
        "EPCCed/Pilot-UKAIFA-Cerebras-workshop episodes/06-prepare-run-fine-tuning.md @1c7f817e84ae", True,
        "Llama-2 7B fine-tuning; the log names the EIDF Cerebras system, not its kind: a CS-2 assumed; "
        "720 samples in 40.4 s between logged steps"),
]


def add_arguments(parser):
    pass


def predict(run):
    """The walk's samples/s for ``run``, and the micro-batch it used."""
    from wse_core.microbatch import MicroBatches
    from wse_core.models import build_model
    from wse_core.perf import Hardware
    from wse_core.perf.memory import largest_micro_batch
    from wse_core.perf.step import walk_step

    model = build_model({**SHAPES[run.model], "max_position_embeddings": run.seq, "mixed_precision": True,
                         "fp16_type": "cbfloat16"})
    hw = Hardware.for_model(model, run.system)
    micro = run.micro_batch or largest_micro_batch(model, MicroBatches.even_sizes(run.batch, run.num_csx), run.seq, hw)
    step = walk_step(model, num_csx=run.num_csx, samples_per_csx=-(-run.batch // run.num_csx),
                     micro_batch_size=micro, seq_len=run.seq, hw=hw, batch_size=run.batch)
    return step, micro


def run(args):
    rows = []
    for r in RUNS:
        step, micro = predict(r)
        rows.append({**asdict(r), "micro_batch_used": micro, "predicted": step.samples_per_s,
                     "ratio": step.samples_per_s / r.published, "step_s": step.step_s,
                     "compute_s": step.compute_s, "exposed_stream_s": step.exposed_stream_s})
    latest = [x for x in rows if x["latest"]]
    within = [x["id"] for x in latest if abs(x["ratio"] - 1) <= 0.25]
    return {"benchmark": "fidelity", "runs": rows, "latest": [x["id"] for x in latest], "within_25pct": within}


def report(result):
    lines = [table([[x["id"], f"{x['num_csx']} x {x['system'].upper()}", x["model"], x["seq"], x["batch"],
                     x["micro_batch_used"] if x["micro_batch"] else f"{x['micro_batch_used']} (auto)",
                     x["release"], f"{x['published']:.2f}", f"{x['predicted']:.2f}", f"{x['ratio']:.2f}",
                     "" if x["latest"] else "earlier release"]
                    for x in result["runs"]],
                   ["run", "systems", "model", "seq", "batch", "micro-batch", "release", "published/s",
                    "model/s", "ratio", ""])]
    n = len(result["latest"])
    lines.append(f"\nwithin 25% of the published figure: {len(result['within_25pct'])} of the {n} runs of the last "
                 f"release logged on each system ({', '.join(result['within_25pct'])}); nothing fitted on any row")
    for x in result["runs"]:
        if x["note"]:
            lines.append(f"  {x['id']}: {x['note']}")
    lines += [f"  {x['id']}: {x['source']}" for x in result["runs"]]
    return "\n".join(lines)
