"""eagle-extract: EAGLE-3 training data from vLLM through public hooks."""

__version__ = "0.1.0"

from .api import Report, Summary, extract, merge, repair, verify  # noqa: E402
from .errors import ExtractError  # noqa: E402

__all__ = ["ExtractError", "Report", "Summary", "extract", "merge", "repair", "verify"]
