"""The release, as the manifest records it."""

__version__ = "0.1.0"
