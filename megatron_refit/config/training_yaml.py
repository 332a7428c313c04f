"""Reading a training YAML: Megatron-Bridge's own ``ConfigContainer`` sections (``model:``,
``train:``, ``optimizer:``, …) plus one ``refit:`` section. :func:`split_refit_section` takes
``refit:`` out and returns the rest unchanged for Bridge's loader
(``process_config_with_overrides``), which would otherwise warn about an unknown key;
:func:`load_training_yaml` reads the file with OmegaConf, as Bridge does; :func:`train_layout`
(:mod:`megatron_refit.config.bridge_model`) is the trainer layout from Bridge's ``model:`` section.
"""

from __future__ import annotations

import typing
from typing import Any

from megatron_refit.config.section import RefitConfig


def split_refit_section(config: dict[str, Any]) -> tuple[dict[str, Any], RefitConfig]:
    """``(the YAML without refit:, RefitConfig)``; the first part goes to Bridge unchanged. A
    top-level key that is a near-miss of ``refit`` (``refti:``) is an error: it would leave
    refit silently off."""
    import difflib

    if not isinstance(config, dict):
        raise ValueError(f"training config: expected a mapping, got {type(config).__name__}")
    if "refit" not in config:
        near = difflib.get_close_matches("refit", [k for k in config if isinstance(k, str)], n=1, cutoff=0.7)
        if near:
            raise ValueError(f"training config: unknown section {near[0]!r}; did you mean 'refit'? (as written, "
                             "refit stays off)")
    rest = {key: value for key, value in config.items() if key != "refit"}
    return rest, RefitConfig.from_dict(config.get("refit"))


def load_training_yaml(path: str, overrides: list[str] | None = None) -> tuple[dict[str, Any], RefitConfig]:
    """Read a training YAML as Megatron-Bridge reads its configs, with OmegaConf: dotted
    ``overrides`` (``["refit.gen_tp=16", "refit.enabled=true"]``, values parsed as YAML) are
    merged over the file, then interpolations are resolved (``${oc.env:REFIT_HOST}``, and
    references to other keys). See :func:`split_refit_section` for what comes back."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(overrides or [])
    bad = [o for o in overrides if not isinstance(o, str) or "=" not in o or o.startswith("=")]
    if bad:
        raise ValueError(f"overrides must be 'dotted.key=value' strings, got {bad}")
    try:
        conf = OmegaConf.load(path)
        if overrides:
            conf = OmegaConf.merge(conf, OmegaConf.from_dotlist(overrides))
        data = OmegaConf.to_container(conf, resolve=True)
        section = conf.get("refit") if OmegaConf.is_dict(conf) else None
        if OmegaConf.is_dict(section) and isinstance(data.get("refit"), dict):
            _decode_interpolated(data["refit"], [k for k in section if OmegaConf.is_interpolation(section, k)])
    except OmegaConfBaseException as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        where = next((line for line in lines if line.startswith("full_key:")), "")
        raise ValueError(f"{path}: cannot read the training config: {lines[0] if lines else type(exc).__name__}"
                         f"{f' ({where})' if where else ''}") from exc
    return split_refit_section(data or {})


def _decode_interpolated(section: dict[str, Any], keys: list[str]) -> None:
    """Environment variables are strings: an interpolated ``refit:`` value that resolved to a
    string is read as YAML where the field is not a string (``port: ${oc.env:REFIT_PORT}``
    gives an int), as OmegaConf's ``oc.decode`` would."""
    import yaml

    hints = typing.get_type_hints(RefitConfig)
    for key in keys:
        value = section.get(key)
        if isinstance(value, str) and key in hints and str not in (typing.get_args(hints[key]) or (hints[key],)):
            try:
                section[key] = yaml.safe_load(value)
            except yaml.YAMLError:
                pass  # left as the string: the type check names the key and the value
