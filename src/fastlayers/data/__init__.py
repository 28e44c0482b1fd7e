"""Loaders for real datasets shipped inside installed packages (read offline)."""

from ._digits8x8 import load_digits_8x8 as load_digits_8x8
from ._fsdd import SpokenDigits as SpokenDigits, load_spoken_digits as load_spoken_digits

__all__ = ["SpokenDigits", "load_spoken_digits", "load_digits_8x8"]
