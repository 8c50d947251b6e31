"""Which queued jobs start on the free CS-2s: a pure function of the queue and the pool, tested alone.

Queued jobs are considered by priority, then in order of submission (``Store.queue``), and a later
job that fits may start ahead of one that does not. That overtaking is bounded: once
``MAX_OVERTAKES`` later jobs have started ahead of a waiting job, nothing behind it starts until it
has, so the CS-2s it needs come free and a large job is never starved by a stream of small ones.
Only root (or the owner of a user's appliance) may raise a job's priority above 0. docs/design/appliance.md
"Scheduling".
"""

#: How many later jobs may start ahead of a waiting job before it holds the pool for itself.
MAX_OVERTAKES = 2


def pick(queue, free, max_overtakes=MAX_OVERTAKES):
    """The jobs of ``queue`` (in its order) to start on ``free`` CS-2s, and the ids of the waiting jobs
    each start passes (one id per passing: a job passed twice is listed twice).

    A job that does not fit lets later ones that do start ahead of it, until ``max_overtakes`` have;
    from then on it holds the pool: nothing behind it starts before it does.
    """
    starts, overtaken, waiting = [], [], []
    for job in queue:
        if job["num_csx"] <= free:
            free -= job["num_csx"]
            starts.append(job)
            overtaken += [w["id"] for w in waiting]
        else:
            waiting.append(job)
            if job["overtaken"] + overtaken.count(job["id"]) >= max_overtakes:
                break
    return starts, overtaken


def cores_for(num_csx, pool_csx, cores):
    """A job's share of this machine's ``cores``: as its share of the pool of ``pool_csx`` CS-2s."""
    return max(1, cores * num_csx // pool_csx)
