"""gemma4serve: a lean inference server for Gemma 4 with MTP speculative decoding."""

from gemma4serve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # LLM pulls in torch and the model code; importing the package (e.g. for the CLI's --help) stays
    # light.
    if name == "LLM":
        from gemma4serve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
