"""Speculative decoding without a draft model: proposers over the request's own tokens (and
earlier requests' outputs), the scheduler's draft bookkeeping, and the on-only-where-it-pays
rule. Pure Python: the worker verifies the drafts (worker/model_runner.py)."""
