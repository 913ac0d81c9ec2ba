"""Typed errors. Each names what went wrong so a caller can act on it."""

from __future__ import annotations


class SlotServeError(Exception):
    """Base class for slotserve's own errors."""


class RequestValidationError(SlotServeError, ValueError):
    """A request was malformed; nothing was changed in the engine.

    `param` names the offending field when there is one (used for OpenAI error bodies).
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ConfigError(SlotServeError, ValueError):
    """The engine's settings are inconsistent or do not fit the model or the memory."""


class SlotOverflowError(AssertionError):
    """The worker slot table was asked for a slot while full.

    Subclasses AssertionError and starts with "No free indices" so it reads like the vLLM
    failure it replaces, but it names the request and the holders.
    """


class InvariantViolation(AssertionError):
    """The invariant checker found the scheduler and the worker model disagreeing."""


class ModelLoadError(SlotServeError):
    """A checkpoint could not be loaded (missing file, bad config, unsupported arch)."""


class EngineDeadError(SlotServeError):
    """The engine core failed, or its process died, and cannot continue."""
