"""Structured outputs on llguidance: grammar texts from constraints (front), compiled matchers
and per-step token bitmasks (core). See docs/STRUCTURED_OUTPUTS.md.

The package imports nothing itself: callers import the submodule they use (`grammar`,
`backend`, `manager`), so that the server's front, which reaches `budget` through the tool
parsers, holds llguidance and numpy (~20 MB resident) only once a request needs a grammar.
"""
