"""Verified comparison harness: same values, same gradients, then forward/backward time and memory."""

from ._harness import CandidateResult as CandidateResult, Report as Report, compare as compare
from ._workloads import WORKLOADS as WORKLOADS, Workload as Workload

__all__ = ["compare", "Report", "CandidateResult", "Workload", "WORKLOADS"]
