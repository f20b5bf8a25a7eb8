"""The methods a run measures, each under a name of its own: grids expanded, collisions named apart.

A run measures `method` and every `compare` entry against one plain-decoding baseline, and reports
them by name (results.jsonl, summary.json, the tables). Two methods with the same `name:` would
overwrite one another, so `expand` gives every method of a run a name no other method has:

- A grid (`grid.method.<setting>=[a,b,...]`, `grid.methods=[ngram,suffix]`) becomes one variant of
  `method` per combination, in the order given, named by its grid values:
  `ngram[num_speculative_tokens=2]`, `suffix[num_speculative_tokens=2,schedule=heuristic]`. The
  first is `method`, the others `compare` entries, so that every variant is checked by `validate`
  before any model loads and all of them share one baseline, prompt by prompt.
- A method named as an earlier one is named by what differs from that earlier one's composed
  config: the differing leaf keys, each by its last part where that is unambiguous
  (`ngram[schedule=heuristic]`, `ngram[max_ngram=2]`); an identical copy by its number (`ngram[2]`).
  A derived name that is taken as well is refused, with the setting that names it by hand.

Models, dtypes and devices cannot share a process: they stay Hydra sweeps (`-m`), whose jobs
`specdec.study.sweep` names apart in the same way, by the override that differs.
"""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from specdec.study.config import ConfigError, MethodConfig, _unknown_part, method_configs

GRID_KEYS = ("method", "methods")  # grid.method.<setting>=[...], grid.methods=[<method>, ...]
BASELINE = "autoregressive"  # specdec.study.report.BASELINE: the name plain decoding's rows carry


def expand(cfg: DictConfig) -> DictConfig:
    """A copy of `cfg` with its grid expanded into `method` and `compare` entries and every measured
    method named apart (see the module docstring). The caller's config is left as it is."""
    cfg = copy.deepcopy(cfg)
    if cfg.get("grid"):
        _expand_grid(cfg)
    name_methods(cfg)
    return cfg


# ---------------------------------------------------------------- grids


def _expand_grid(cfg: DictConfig) -> None:
    grid = OmegaConf.to_container(cfg.grid, resolve=True)
    for key in grid:
        if key not in GRID_KEYS:
            raise ConfigError(f"grid.{key}: a grid varies the method within one run (grid.method.<setting>=[...], "
                              f"grid.methods=[<method>,...]); {key} needs a process of its own: sweep it with "
                              f"-m {key}=<a>,<b>")
    names = grid.get("methods")
    if names is not None and (not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names)):
        raise ConfigError(f"grid.methods: a list of method names (files of conf/method/), e.g. [ngram,suffix]; "
                          f"got {names!r}")
    settings = grid.get("method") or {}
    if not isinstance(settings, dict):
        raise ConfigError(f"grid.method: settings of the method with a list of values each, e.g. "
                          f"grid.method.num_speculative_tokens=[2,4,8]; got {settings!r}")
    axes = _leaves(settings)
    for key, values in axes.items():
        if _unknown_part(["method", *key.split(".")]) is not None or key == "name":
            raise ConfigError(f"grid.method.{key}: not a setting of a method (python -m specdec --cfg job "
                              "lists them)")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"grid.method.{key}: a list of the values to measure, e.g. [2,4,8]; got {values!r}")
    bases = [cfg.method] if names is None else [_method(cfg, n) for n in names]
    labels = short_keys(list(axes))
    variants = []
    for base, values in itertools.product(bases, itertools.product(*axes.values())):
        m = copy.deepcopy(base)
        with open_dict(m):
            for key, value in zip(axes, values):
                OmegaConf.update(m, key, value, merge=False)
        if axes:
            m.name = f"{base.name}[{','.join(f'{labels[k]}={_value(v)}' for k, v in zip(axes, values))}]"
        variants.append(m)
    compare = dict(cfg.compare)
    with open_dict(cfg):
        cfg.method = variants[0]
        cfg.compare = {**{_key(m.name): m for m in variants[1:]}, **compare}
        cfg.grid = {}


def _method(cfg: DictConfig, name: str) -> DictConfig:
    """The method `name`: the run's own `method` where it is that one (its command-line settings
    kept), else `conf/method/<name>.yaml` over the schema's defaults."""
    if name == cfg.method.name:
        return cfg.method
    from specdec.study.registry import config_roots, options

    for root in config_roots():
        file = root / "method" / f"{name}.yaml"
        if file.is_file():
            node = OmegaConf.merge(OmegaConf.structured(MethodConfig), OmegaConf.create(file.read_text(encoding="utf-8")))
            return node
    raise ConfigError(f"grid.methods: no method {name!r}; choose from: {', '.join(options('method'))}")


def _leaves(node: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf of `node`; a list is a leaf (a grid's values)."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _key(name: str) -> str:
    """A `compare` key for a variant's name (`ngram[num_speculative_tokens=2]`: ngram_num_speculative_tokens_2)."""
    return "_".join("".join(c if c.isalnum() else " " for c in name).split())


def _value(value: Any) -> str:
    """A value as a name shows it: a scalar as written, a list or mapping as compact JSON."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each dotted key by its last part, or whole where two keys share their last part."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


# ---------------------------------------------------------------- names


def name_methods(cfg: DictConfig) -> None:
    """Rename, in place, every measured method whose name an earlier one has (module docstring)."""
    first: dict[str, tuple[str, dict]] = {}  # name -> (config key, composed config) of the first with it
    copies: dict[str, int] = {}
    taken = {m.name for _, m in method_configs(cfg)}
    for key, m in method_configs(cfg):
        if m.proposer is None and m.decoder is None:  # plain decoding: the baseline itself, not a row of its own
            continue
        name = m.name
        if name == BASELINE:
            raise ConfigError(f"{key}.name: `{BASELINE}` names the plain-decoding baseline of every run; give "
                              f"this method another name: {key}.name=<name>")
        mine = _composed(m)
        if name not in first:
            first[name] = (key, mine)
            continue
        other_key, other = first[name]
        differ = [k for k in dict.fromkeys([*other, *mine]) if k != "name" and other.get(k) != mine.get(k)]
        if differ:
            labels = short_keys(differ)
            new = f"{name}[{','.join(f'{labels[k]}={_value(mine.get(k))}' for k in differ)}]"
        else:
            copies[name] = copies.get(name, 1) + 1
            new = f"{name}[{copies[name]}]"
        if new in taken:
            raise ConfigError(f"{key}.name: {key} and {other_key} are both named {name}, and {new} is taken too; "
                              f"name it yourself: {key}.name=<name>")
        m.name = new
        taken.add(new)


def _composed(m: DictConfig) -> dict[str, Any]:
    """A method's config as dotted leaves (interpolations resolved where they can be)."""
    try:
        plain = OmegaConf.to_container(m, resolve=True)
    except Exception:  # an interpolation that points outside the node: compare it as written
        plain = OmegaConf.to_container(m, resolve=False)
    return _leaves(plain)
