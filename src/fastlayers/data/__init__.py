"""Loaders for real datasets shipped inside installed packages (read offline)."""

from ._fsdd import SpokenDigits as SpokenDigits, load_spoken_digits as load_spoken_digits

__all__ = ["SpokenDigits", "load_spoken_digits"]
