"""Invariant checking: a reference model of the worker that every SchedulerOutput must satisfy."""

from slotserve.check.checker import InvariantChecker

__all__ = ["InvariantChecker"]
