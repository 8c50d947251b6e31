"""Fused in-place optimizers (SGD, momentum, Adam, AdamW), gradient clipping and LR schedules."""
from wse_core.optim.clip import clip_coefficient, clip_grad_norm_, global_norm, sum_of_squares
from wse_core.optim.optimizers import SGD, Adam, AdamW, Optimizer, make_optimizer
from wse_core.optim.schedules import Chained, Constant, CosineDecay, Linear, Schedule, Sequential, make_schedule

__all__ = [
    "SGD", "Adam", "AdamW", "Optimizer", "make_optimizer",
    "global_norm", "sum_of_squares", "clip_coefficient", "clip_grad_norm_",
    "Schedule", "Constant", "Linear", "CosineDecay", "Sequential", "Chained", "make_schedule",
]
