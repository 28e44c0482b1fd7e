"""Functional forms of fastlayers' layers."""

from .attention import attention_pool as attention_pool
from .local import locally_connected1d as locally_connected1d, locally_connected2d as locally_connected2d

__all__ = ["attention_pool", "locally_connected1d", "locally_connected2d"]
