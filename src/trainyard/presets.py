"""Named params presets (presets/NAME.yaml) as `dvc exp run -S key=value` flags.

dvc exp run $(python -m trainyard.presets fast)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from trainyard.core.config import flatten, parse_params

PRESETS_DIR = Path("presets")


def preset_flags(
    name: str, presets_dir: Path = PRESETS_DIR, params_file: Path = Path("params.yaml")
) -> list[str]:
    """``-S key=value`` pairs for the preset, validated against the full params first."""
    path = presets_dir / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in presets_dir.glob("*.yaml"))
        raise SystemExit(f"unknown preset {name!r}: no {path} (presets: {', '.join(known)})")
    overrides = yaml.safe_load(path.read_text()) or {}
    merged = yaml.safe_load(params_file.read_text())
    for section, values in overrides.items():
        merged.setdefault(section, {}).update(values)
    parse_params(merged, f"{params_file} + {path}")  # a bad preset fails here, named
    flags: list[str] = []
    for key, value in flatten(overrides).items():
        flags += ["-S", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    return flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("name")
    print(" ".join(preset_flags(parser.parse_args().name)))


if __name__ == "__main__":
    main()
