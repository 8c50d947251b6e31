"""Layer numerics (forward and backward), models as streaming units, and the reference training step."""
from wse_core.nn.layers import Dense, Embedding, LMHead, ParamSpec, TransformerBlock, Unit
from wse_core.nn.models import GPT2, Classifier, LanguageModel, Llama, Model, build_model
from wse_core.nn.reference import StepResult, accumulate, micro_batch_ranges, reference_step

__all__ = ["Unit", "ParamSpec", "Embedding", "TransformerBlock", "LMHead", "Dense", "Model", "LanguageModel",
           "GPT2", "Llama", "Classifier",
           "build_model", "StepResult", "accumulate", "micro_batch_ranges", "reference_step"]
