"""The CPU backend's steps: the single-process reference's, on the run's dataset."""

# The kernels (data_tools.dataset, wse_core.models, wse_core.optim, wse_core.nn) are imported where used:
# importing the package (cerebras.pytorch) loads none of them.


class InProcess:
    """The CPU backend: the reference's steps (``wse_core.nn.reference``) on the run's dataset, as the
    cluster's ranks compute them: the same bits."""

    def __init__(self, spec, start=0, resumed=None, loss_scale=None):
        from data_tools.dataset import GlobalStream
        from wse_core.models import build_model
        from wse_core.optim import make_schedule
        from wse_core.optim.loss_scale import LossScaler

        self.spec = spec
        self.model = build_model(self.spec.model)
        o, t = self.spec.optimizer, self.spec.train_input
        self.seed = self.spec.runconfig.seed
        self.optimizer = o.optimizer()
        if resumed is None:
            self.params = self.model.init_params(self.seed)
            self.state = {n: self.optimizer.init_state(w) for n, w in self.params.items()}
        else:
            self.params, self.state = resumed
        self.schedule = make_schedule(o.learning_rate, key="optimizer.learning_rate")
        self.scaler = LossScaler.from_params(o, self.model.config.get("fp16_type"))
        self.scaler.load(loss_scale)
        self.stream = GlobalStream(t.data_dir)
        self.step = start

    def advance(self):
        from wse_core.nn.reference import reference_step

        t, o = self.spec.train_input, self.spec.optimizer
        batch = self.model.batch_of(self.stream.read(self.step * t.batch_size, t.batch_size))
        r = reference_step(self.model, self.params, self.state, self.optimizer, batch,
                           micro_batch_size=t.micro_batch_size, step=self.step + 1, lr=self.schedule(self.step),
                           max_gradient_norm=o.max_gradient_norm, seed=self.seed, scaler=self.scaler,
                           lr_factors=self.model.lr_factors(o.adjust_learning_rate))
        self.step += 1
        return r
