"""hybrid-model: see the package README for the public API."""

__version__ = "0.14.0"

__all__ = ["__version__"]
