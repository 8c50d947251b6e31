"""`wse demo`: the main job on built-in defaults, nothing to download.

It preprocesses the standard library's own Python sources (a real corpus every machine has) into
HDF5 shards, every 50th file held out for evaluation (`wse validate wse_demo/params.yaml`), then
trains a small GPT-2 in weight-streaming mode on an emulated cluster of 2 CS-2 systems, 1 MemoryX,
a SwarmX root and 2 input workers (7 MPI ranks, started by `wse fit`), shows what the model writes,
and prints where the outputs are.

The model is the largest that learns the look of Python in about 40 s of a 2-core machine's time
(4 layers of 128, 600 steps of 32 sequences of 64 bytes: loss 5.4 -> 1.7 nats a byte); smaller ones
trained as long wrote `def main(eeeeeeee` (docs/benchmarks.md, the demo).
"""
import shutil
import time

import yaml

from data_tools.documents import stdlib_sources
from pyapi.generate import Generator
from pyapi.job import Job, JobError
from pyapi.params import DEMO_DIR  # where it writes: the examples' params read its data from there
from wse_core.checks import plural
# data_tools.lmdata and data_tools.preprocess (h5py) are imported where the demo's data is prepared.
#: One source file in this many is held out of training for evaluation: sources spread over the whole
#: library (about 2%, 16 of 799 files in Python 3.11), so the eval loss is that of unseen code like the
#: training code. The training data itself would flatter the model, and all 197,000 of its examples
#: would take minutes to evaluate.
HOLD_OUT_EVERY = 50
PARAMS = {
    "train_input": {"data_dir": str(DEMO_DIR / "data"), "batch_size": 32, "micro_batch_size": "auto",
                    "shuffle": True, "shuffle_seed": 1},
    "eval_input": {"data_dir": str(DEMO_DIR / "eval_data"), "batch_size": 16},
    "model": {"name": "gpt2", "vocab_size": 257, "hidden_size": 128, "num_hidden_layers": 4, "num_heads": 4,
              "max_position_embeddings": 64},
    "optimizer": {"optimizer_type": "AdamW", "weight_decay": 0.01, "max_gradient_norm": 1.0,
                  "learning_rate": [
                      {"scheduler": "Linear", "initial_learning_rate": 0.0, "end_learning_rate": 3e-3, "total_iters": 60},
                      {"scheduler": "CosineDecay", "initial_learning_rate": 3e-3, "end_learning_rate": 3e-4,
                       "total_iters": 540}]},
    "runconfig": {"max_steps": 600, "checkpoint_steps": 300, "log_steps": 50, "num_csx": 2, "num_wgt_servers": 1,
                  "num_workers_per_csx": 1, "model_dir": str(DEMO_DIR / "model"), "seed": 0},
}


def prepare():
    """The demo's data (training and held-out) and its params.yaml, in DEMO_DIR; the data is reused
    when both parts are there."""
    from data_tools.lmdata import DATA_PARAMS
    from data_tools.preprocess import preprocess_text

    data, eval_data = DEMO_DIR / "data", DEMO_DIR / "eval_data"
    print(f"wse demo: 1/2 preprocessing the standard library's Python sources into {data}/, every "
          f"{HOLD_OUT_EVERY}th file held out into {eval_data}/", flush=True)
    if (data / DATA_PARAMS).exists() and (eval_data / DATA_PARAMS).exists():
        print("  (already there: reusing it)")
    else:  # both anew: a data/ of an earlier demo holds the held-out files too
        files = stdlib_sources()
        held_out = set(files[::HOLD_OUT_EVERY])
        for out, part in ((data, [f for f in files if f not in held_out]), (eval_data, sorted(held_out))):
            p = preprocess_text(part, out, 64, samples_per_file=8192, processes=2, overwrite=True)
            print(f"  {plural(p['input_files'], 'file')}, {p['input_bytes'] / 1e6:.1f} MB, {p['n_tokens']:,} tokens -> "
                  f"{p['n_examples']:,} examples of 64 tokens in {plural(len(p['files']), 'HDF5 file')}")
    DEMO_DIR.mkdir(exist_ok=True)
    (DEMO_DIR / "params.yaml").write_text(yaml.safe_dump(PARAMS, sort_keys=False))


def main():
    t0 = time.perf_counter()
    prepare()
    data, model_dir = DEMO_DIR / "data", DEMO_DIR / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)  # the demo's own scratch output: always a fresh run
    print("wse demo: 2/2 training a 4-layer GPT-2 on 2 CS-2s (1 MemoryX, SwarmX, 2 input workers): "
          f"`wse fit {DEMO_DIR / 'params.yaml'}`", flush=True)
    try:
        result = Job.from_dict(PARAMS).fit()
    except JobError as exc:
        print(f"wse demo: {exc}")
        return 1
    m = result.metrics
    first, last = m[0]["loss"], sum(x["loss"] for x in m[-10:]) / 10
    print(f"\nwse demo: loss {first:.3f} -> {last:.3f} (mean of the last 10 steps) in {len(m)} steps; "
          f"{time.perf_counter() - t0:.0f} s in all")
    run = PARAMS["runconfig"]
    checkpoints = ", ".join(f"checkpoint_{k}/" for k in range(run["checkpoint_steps"], run["max_steps"] + 1,
                                                                run["checkpoint_steps"]))
    print(f"  outputs in {model_dir}/: metrics.jsonl, plan.json, params.yaml, logs/ (one per rank), "
          f"{checkpoints} (latest)")
    print(f"  look at them: `wse checkpoint info {model_dir}`, `wse validate {DEMO_DIR / 'params.yaml'}` (eval loss "
          f"on the held-out files), `wse compile {DEMO_DIR / 'params.yaml'}`, `wse data inspect {data}`")
    show_sample(model_dir)
    return 0


#: What the demo asks its model to continue, sampled: greedy decoding of a model this small repeats one
#: byte (`def main(eeeeeeee`), sampling at 0.7 shows what it learned.
SAMPLE = {"prompt": "def ", "max_new_tokens": 60, "temperature": 0.7, "seed": 0}


def show_sample(model_dir):
    """Print what the trained model writes, and the command that writes it again."""
    text = Generator.load(model_dir).generate(SAMPLE["prompt"], SAMPLE["max_new_tokens"],
                                              temperature=SAMPLE["temperature"], seed=SAMPLE["seed"])[0].text
    print(f"  what it writes (`wse generate {model_dir} --prompt {SAMPLE['prompt']!r} --temperature "
          f"{SAMPLE['temperature']} --seed {SAMPLE['seed']}`): the look of Python after a minute of bytes, "
          "not yet its sense:")
    for line in (SAMPLE["prompt"] + text).splitlines():
        if line.strip():
            print(f"    | {line}")
