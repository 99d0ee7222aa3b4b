"""eagle-extract: EAGLE-3 training data from vLLM through public hooks."""

__version__ = "0.1.0"
