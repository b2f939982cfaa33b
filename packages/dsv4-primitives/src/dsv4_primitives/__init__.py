"""dsv4-primitives: see the package README for the public API."""

__version__ = "0.1.0"

__all__ = ["__version__"]
