"""``cstorch.optim.lr_scheduler``: Cerebras' schedulers, as the run's ``optimizer.learning_rate``
(``wse_core.optim.schedules``: the same closed forms, computed for every step by the coordinator).
A scheduler attaches itself to its optimizer; ``step()`` in the traced step does nothing more.
Its ``state_dict()`` holds ``last_epoch``, the steps the script has seen (the schedule is a function
of the step, so a resumed run needs nothing else of it); after each step the optimizer's groups
hold the next step's rate, as torch's do (``get_last_lr``)."""
from pyapi.cstorch.errors import not_built, refusing
from wse_core.errors import DataError
# wse_core.optim is imported where used: it loads the kernels, which importing the package does not.


class LRScheduler:
    name = None

    def __init__(self, optimizer, **args):
        self.optimizer = optimizer
        self.args = {k: v for k, v in args.items() if v is not None}
        optimizer.scheduler = self.spec()
        optimizer.lr_scheduler = self
        self.last_epoch = 0
        self.seen = None  # the last step the script has seen, when it is ahead of last_epoch

    def state_dict(self):
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("last_epoch"), int):
            raise DataError(f"{type(self).__name__}.load_state_dict: expected {{'last_epoch': steps trained}}")
        self.last_epoch, self.seen = state_dict["last_epoch"], None

    def spec(self):
        return {"scheduler": self.name, **self.args}

    def step(self, *args):
        """Inside the traced step: the coordinator sets each step's rate."""

    def get_last_lr(self):
        """Each parameter group's rate for the step after the last one the script has seen (as torch's):
        the schedule's there, times the group's share of the first group's ``lr``."""
        from wse_core.optim import make_schedule

        step = self.last_epoch if self.seen is None else max(self.seen, self.last_epoch)
        rate = make_schedule(self.spec(), key=f"{type(self).__name__}")(step)
        return [rate * factor for factor in self.optimizer.lr_factors]


class ConstantLR(LRScheduler):
    name = "Constant"

    def __init__(self, optimizer, learning_rate, total_iters=None):
        super().__init__(optimizer, learning_rate=learning_rate, total_iters=total_iters)


class LinearLR(LRScheduler):
    name = "Linear"

    def __init__(self, optimizer, initial_learning_rate, end_learning_rate, total_iters, cycle=False):
        super().__init__(optimizer, initial_learning_rate=initial_learning_rate, end_learning_rate=end_learning_rate,
                         total_iters=total_iters, cycle=cycle or None)


class PolynomialLR(LRScheduler):
    name = "Polynomial"

    def __init__(self, optimizer, initial_learning_rate, end_learning_rate, total_iters, power=1.0, cycle=False):
        super().__init__(optimizer, initial_learning_rate=initial_learning_rate, end_learning_rate=end_learning_rate,
                         total_iters=total_iters, power=power, cycle=cycle or None)


class CosineDecayLR(LRScheduler):
    name = "CosineDecay"

    def __init__(self, optimizer, initial_learning_rate, end_learning_rate, total_iters):
        super().__init__(optimizer, initial_learning_rate=initial_learning_rate, end_learning_rate=end_learning_rate,
                         total_iters=total_iters)


class ExponentialLR(LRScheduler):
    name = "Exponential"

    def __init__(self, optimizer, initial_learning_rate, total_iters, decay_rate, staircase=False):
        super().__init__(optimizer, initial_learning_rate=initial_learning_rate, total_iters=total_iters,
                         decay_rate=decay_rate, staircase=staircase)


class SequentialLR(LRScheduler):
    """``schedulers`` one after the other, switching at ``milestones``; the optimizer takes the sequence."""

    name = "Sequential"

    def __init__(self, optimizer, schedulers, milestones, last_epoch=-1):
        if last_epoch != -1:
            raise not_built("SequentialLR(last_epoch=...)", "a schedule starts at step 0")
        super().__init__(optimizer, schedulers=[s.spec() for s in schedulers], milestones=list(milestones))


__getattr__ = refusing("cstorch.optim.lr_scheduler", "built: ConstantLR, LinearLR, PolynomialLR, CosineDecayLR, "
                      "ExponentialLR, SequentialLR")
