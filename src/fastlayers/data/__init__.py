"""Loaders for real datasets shipped inside installed packages (read offline)."""

from ._batching import batches as batches, concat_batch as concat_batch, pad_batch as pad_batch, stratified_split as stratified_split, subset as subset
from ._digits8x8 import load_digits_8x8 as load_digits_8x8
from ._fsdd import SpokenDigits as SpokenDigits, load_spoken_digits as load_spoken_digits
from ._sequences import Sequences as Sequences
from ._vowels import load_japanese_vowels as load_japanese_vowels

__all__ = ["Sequences", "SpokenDigits", "load_spoken_digits", "load_digits_8x8", "load_japanese_vowels", "batches",
           "pad_batch", "concat_batch", "stratified_split", "subset"]
