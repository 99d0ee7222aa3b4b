"""eagle-extract: EAGLE-3 training data from vLLM through public hooks."""

from .errors import ExtractError
from .faces.api import Report, Summary, extract, merge, repair, verify
from .version import __version__

__all__ = ["ExtractError", "Report", "Summary", "__version__", "extract", "merge", "repair", "verify"]
