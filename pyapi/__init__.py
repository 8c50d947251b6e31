"""What a user touches: params schema and validation, the Job API and the `wse` command line."""


def __getattr__(name):
    # Lazy, so `wse --help` does not import the numerics.
    if name in ("Job", "JobError", "FitResult"):
        from pyapi import job

        return getattr(job, name)
    raise AttributeError(name)
