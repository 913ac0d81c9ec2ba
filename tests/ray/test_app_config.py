"""The Ray app's configuration, without a cluster: model specs are checked before anything
starts, a Serve config's `args` dict builds the same app, and only slotserve/ray imports Ray."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

from slotserve.errors import ConfigError  # noqa: E402
from slotserve.ray import build_app  # noqa: E402
from slotserve.ray.app import ModelDeployment  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[2] / "slotserve"


def test_specs_are_checked_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="unknown router"):
        ModelDeployment.from_dict({"name": "a", "router": "nearest"})
    with pytest.raises(ConfigError, match="unknown engine argument"):
        ModelDeployment.from_dict({"name": "a", "engine_kwargs": {"max_num_seq": 4}})
    with pytest.raises(ConfigError, match="num_replicas"):
        ModelDeployment.from_dict({"name": "a", "num_replicas": 0})
    with pytest.raises(ConfigError, match="unique"):
        build_app(models=[{"name": "a"}, {"name": "a"}])
    with pytest.raises(ConfigError, match="at least one model"):
        build_app(models=[])
    with pytest.raises(ConfigError, match="empty"):
        build_app(models=[{"name": "a"}], api_key="")


def test_a_serve_config_args_dict_builds_the_app() -> None:
    spec = ModelDeployment.from_dict({"name": "small", "model": "~/m", "num_replicas": 3,
                                      "engine_kwargs": {"max_num_seqs": 8}})
    assert spec.engine_kwargs == {"max_num_seqs": 8, "model": "~/m"}
    assert spec.model_path.endswith("/m") and not spec.model_path.startswith("~")
    app = build_app({"models": [{"name": "a", "num_replicas": 2},
                                {"name": "b", "router": "pow2"}], "api_key": "k"})
    assert type(app).__name__ == "Application"


def test_only_the_ray_package_imports_ray() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(PACKAGE / "ray"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            offenders += [f"{path}: {n}" for n in names if n.split(".")[0] == "ray"]
    assert offenders == []
