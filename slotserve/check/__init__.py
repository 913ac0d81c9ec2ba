"""Invariant checking: a reference model of the worker that every SchedulerOutput must satisfy."""

from slotserve.check.checker import InvariantChecker, checking_enabled

__all__ = ["InvariantChecker", "checking_enabled"]
