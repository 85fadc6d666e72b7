"""sous: a vLLM-compatible serving engine and OpenAI server in Python."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):  # lazy: `import sous` must not import torch
    if name == "LLM":
        from sous.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from sous.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
