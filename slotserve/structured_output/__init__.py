"""Structured outputs on llguidance: grammar texts from constraints (front), compiled matchers
and per-step token bitmasks (core). See docs/STRUCTURED_OUTPUTS.md."""

from slotserve.structured_output.backend import GrammarCompileError, GuidanceBackend
from slotserve.structured_output.grammar import checked_grammar
from slotserve.structured_output.manager import StructuredOutputManager, StructuredOutputStats

__all__ = ["GrammarCompileError", "GuidanceBackend", "StructuredOutputManager",
           "StructuredOutputStats", "checked_grammar"]
