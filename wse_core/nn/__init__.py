"""Layer numerics (forward and backward), models as streaming units, and the reference training step.

Modules: ``layers`` and ``llama``'s units (numerics), ``init`` (initializers), ``model`` (the base
class, parameters and their memory), the families ``gpt``, ``llama``, ``mlp`` (each with its build
from the params, on the shared ``checks``), ``reference`` (the step). ``wse_core.models.build_model``
builds a model from the params.
"""
from wse_core.nn.gpt import GPT2
from wse_core.nn.layers import Dense, Embedding, LMHead, ParamSpec, TransformerBlock, Unit
from wse_core.nn.llama import Llama
from wse_core.nn.mlp import Classifier
from wse_core.nn.model import LanguageModel, Model
from wse_core.nn.reference import StepResult, accumulate, reference_step

__all__ = ["Unit", "ParamSpec", "Embedding", "TransformerBlock", "LMHead", "Dense", "Model", "LanguageModel",
           "GPT2", "Llama", "Classifier",
           "StepResult", "accumulate", "reference_step"]
