"""Runnable demos on real data (``fastlayers demo``)."""
