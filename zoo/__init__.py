"""zoo: a plugin-based LLM inference runtime."""

from zoo.description import ModelDescription
from zoo.errors import RequestError, ZooError
from zoo.decoding import DecodingMethod, DraftBlock, HeadsTrainer
from zoo.plugins import Scope, hookimpl
from zoo.sampling_params import SamplingParams

__all__ = ["LLM", "ModelDescription", "SamplingParams", "DraftBlock", "DecodingMethod", "HeadsTrainer", "Scope", "ZooError",
           "RequestError", "hookimpl"]


def __getattr__(name):
    # zoo.LLM pulls in the engine (and torch); plugins importing zoo.hookimpl should not pay for it.
    if name == "LLM":
        from zoo.llm import LLM

        return LLM
    raise AttributeError(name)
