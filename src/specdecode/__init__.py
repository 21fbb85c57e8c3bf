"""specdecode: lossless speculative decoding for LLM text generation."""

__version__ = "0.1.0"
