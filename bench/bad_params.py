"""The fault campaign's bad params files (bench/faults.py): what a user could write by mistake."""

#: The campaign's bad params files: (what is wrong, the params' text or a special file's kind), each given to
#: `wse compile` and `wse fit`; but data a file names is read by fit alone (compile plans without it).
BAD_PARAMS = [
    ("an unknown section", "train_inptu: {}\n"),
    ("an unknown key", "runconfig: {max_stpes: 5}\n"),
    ("a string for a number", "runconfig: {max_steps: many}\n"),
    ("a negative count", "runconfig: {max_steps: -3}\n"),
    ("NaN learning rate", "optimizer: {learning_rate: .nan}\n"),
    ("infinite learning rate", "optimizer: {learning_rate: .inf}\n"),
    ("a million layers", "model: {num_hidden_layers: 1000000}\n"),
    ("100,000 input workers", "runconfig: {num_workers_per_csx: 100000}\n"),
    ("a batch of 1e9", "train_input: {batch_size: 1000000000}\n"),
    ("max_steps 1e30", "runconfig: {max_steps: 1.0e+30}\n"),
    ("1000 CS-2s", "runconfig: {num_csx: 1000}\n"),
    ("a hidden size the heads do not divide", "model: {hidden_size: 31}\n"),
    ("a duplicate key", "runconfig: {max_steps: 5, max_steps: 6}\n"),
    ("a list for a section", "model: [1, 2]\n"),
    ("YAML that does not parse", "model: {hidden_size: [\n"),
    ("an alias bomb", "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                      "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
                      "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e, *e]\n"),
    ("nesting 10,000 deep", "model: " + "[" * 10000 + "]" * 10000 + "\n"),
    ("not UTF-8", b"model: {name: \xff\xfe}\n"),
    ("a missing data_dir", "train_input: {data_dir: /nonexistent/data}\n"),
    ("an empty file", ""),
    ("a directory", "dir"),
    ("a FIFO nobody writes", "fifo"),
    ("/dev/zero", "/dev/zero"),
]
