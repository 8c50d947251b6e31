"""The appliance: a service owning a pool of emulated CS-2s that queues, runs and restarts users' jobs.

It sits above the Job it runs (``runner`` trains with ``pyapi.job.Job``); its client side (the socket's
place, ``Client``, ``SubmittedJob``, ``JobState``) is ``pyapi.client``, below the Job, and what a caller
catches is in ``pyapi.errors``. The service is split by what each part does
(docs/design/appliance.md "The service"), after Slurm's controller and Ray's job service:

    service    the service: its state directory, the requests' handlers, ``python -m`` entry point
    server     transport: the unix socket, connections and their limits, the select loop
    requests   one dataclass per request, its fields checked on arrival
    checker    the forked child that checks a submission's params as the caller, under rlimits
    manager    the job manager: jobs' transitions, their runners, restarts and progress
    scheduler  ``pick``: which queued jobs start on the free CS-2s (a pure function)
    launch     starting a runner as the job's user, with the submitter's numerics variables
    store      the jobs table (SQLite) in the state directory
    runner     one attempt of a job (``python -m pyapi.appliance.runner``)
    slurm      handing jobs to Slurm (``python -m pyapi.appliance.slurm`` inside the allocation)
"""
