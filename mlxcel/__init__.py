"""mlxcel: an OpenAI-compatible LLM inference server on MLX with an adaptive MTP policy."""

__version__ = "0.1.0"
