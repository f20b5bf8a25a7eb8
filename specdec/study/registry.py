"""One way to name an implementation: a `_target_` node, or the short name of a file that holds one.

Every pluggable part is built, as `hydra.utils.instantiate` would build it, from a node `{_target_: module.Attr, **args}`.
Where a config key takes a short name instead (`method.verifier=typical`, `method.schedule=cost_aware`,
`data.source=spec_bench`, `logger.kind=wandb`), the name is a file: the option `X` of key `a.b` is
`conf/a/b/X.yaml`, holding the node, just as the option `X` of Hydra's group `a` is `conf/a/X.yaml`.
So a new verifier or schedule is one module and one YAML file; a folder of your own on
`hydra.searchpath` adds options the same way it adds configs, and the valid names are always the
files found, never a list kept beside them.

Files are looked up along Hydra's config search path when a Hydra job is running (the package's
`conf/` plus every `hydra.searchpath` entry, first match wins, as for configs), else in the package's
`conf/` alone. A name that is not there fails with the options that are.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from specdec.core.arguments import check_args, check_arguments, takes, type_problem, wrong_types  # noqa: F401 (handed on)

PACKAGE_CONF = "specdec.conf"


def _plain(value: Any) -> Any:
    """A config value as plain Python (dicts, lists, scalars). OmegaConf is imported only when the value
    is one of its containers: the decoding core reads its parts here on machines that have torch and
    transformers but none of the harness's dependencies (hydra, omegaconf)."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


def _package_conf() -> Any:
    """The package's configs: `specdec.conf` when installed, a clone's `conf/` otherwise (as the app)."""
    if importlib.util.find_spec(PACKAGE_CONF) is not None:
        return resources.files(PACKAGE_CONF)
    return Path(__file__).resolve().parents[2] / "conf"


def config_roots() -> list[Any]:
    """The folders configs are read from, in Hydra's order (paths or importlib Traversables)."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:  # no Hydra installed: no job can be running
        return [_package_conf()]
    if not HydraConfig.initialized():
        return [_package_conf()]
    roots: list[Any] = []
    for source in HydraConfig.get().runtime.config_sources:
        if source.schema == "file":
            roots.append(Path(source.path))
        elif source.schema == "pkg":
            try:
                roots.append(resources.files(source.path))
            except ModuleNotFoundError:  # Hydra warns about an unavailable source itself
                continue
    return roots


def _folder(root: Any, folder: str) -> Any:
    for part in folder.split("/"):
        root = root / part
    return root


def options(folder: str) -> list[str]:
    """The names available under `folder` (e.g. "method/verifier"): its YAML files, sorted."""
    names = set()
    for root in config_roots():
        where = _folder(root, folder)
        if where.is_dir():
            names.update(f.name[: -len(".yaml")] for f in where.iterdir() if f.name.endswith(".yaml"))
    return sorted(names)


def node(folder: str, spec: Any, key: str) -> dict:
    """The `_target_` node of `spec` as a plain dict: a name looked up as `<folder>/<name>.yaml`, or a node."""
    spec = _plain(spec)
    if isinstance(spec, str):
        for root in config_roots():
            file = _folder(root, folder) / f"{spec}.yaml"
            if file.is_file():
                loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
                if not isinstance(loaded, dict) or "_target_" not in loaded:
                    raise ValueError(f"{key}={spec}: {file} must be a mapping with a `_target_`")
                return loaded
        names = options(folder)
        raise ValueError(f"unknown {key} {spec!r}; choose one of: {', '.join(names) or '(none)'} "
                         f"(files in conf/{folder}/; add <name>.yaml there or in a folder on hydra.searchpath)")
    if isinstance(spec, Mapping) and "_target_" in spec:
        return dict(spec)
    raise ValueError(f"{key}: must be a name or a mapping with a `_target_`, got {spec!r}")


def target_of(path: Any, key: str) -> Any:
    """The attribute a `_target_` names, imported (nothing is instantiated)."""
    if not isinstance(path, str) or "." not in path:
        raise ValueError(f"{key}._target_: must be a dotted path such as specdec.core.verify.GreedyVerifier, got {path!r}")
    module, _, attr = path.rpartition(".")
    try:
        found = importlib.import_module(module)
    except ImportError as err:
        raise ValueError(f"{key}._target_: cannot import {module!r} ({err})") from None
    if not hasattr(found, attr):
        raise ValueError(f"{key}._target_: module {module!r} has no {attr!r}")
    return getattr(found, attr)


def resolve(folder: str, spec: Any, key: str, args: Mapping | None = None, passed: Iterable[str] = (),
            offered: Mapping | None = None) -> tuple[dict, Any, dict, dict]:
    """Everything `build` checks, without building: (node, target, the user's args, the offered
    settings the target takes). Raises ValueError naming `key` for a name, target or argument that
    cannot work."""
    spec_node = node(folder, spec, key)
    label = f"{key}={spec}" if isinstance(spec, str) else key
    target = target_of(spec_node["_target_"], key)
    args = dict(_plain(args) or {})
    offered = {k: v for k, v in (offered or {}).items() if takes(target, k)}  # settings have one name each
    fixed = [k for k in spec_node if not str(k).startswith("_")]
    nested = [k for k in fixed if isinstance(spec_node[k], Mapping) and "_target_" in spec_node[k]]
    check_arguments(target, label, key, args, [*passed, *offered], fixed, nested)
    return spec_node, target, args, {k: v for k, v in offered.items() if v is not None}


def build(folder: str, spec: Any, key: str, args: Mapping | None = None, offered: Mapping | None = None,
          **passed: Any) -> Any:
    """The object `spec` names: `instantiate(node, **offered, **passed, **args)`; an object that is
    neither a name nor a node is returned as it is. `passed` are the caller's arguments (always given),
    `offered` settings given only if the target takes them and they are not None (a data source's
    `path`, a tracker's `project`), `args` the user's own (`<key>_args`)."""
    if not isinstance(_plain(spec), (str, Mapping)):
        return spec
    spec_node, target, args, offered = resolve(folder, spec, key, args, passed, offered)
    fixed = {k: instantiate(v) for k, v in spec_node.items() if not str(k).startswith("_")}
    offered = {k: _plain(v) for k, v in offered.items()}
    return target(**{**fixed, **offered, **passed, **args})


def instantiate(value: Any) -> Any:
    """Hydra's `instantiate` for plain values, recursively: a mapping with a `_target_` is built from
    its other keys; lists and mappings are rebuilt; anything else is returned as it is. The target's
    own errors come through unwrapped, so they name the offending value."""
    if isinstance(value, Mapping):
        built = {k: instantiate(v) for k, v in value.items() if not str(k).startswith("_")}
        return target_of(value["_target_"], "_target_")(**built) if "_target_" in value else built
    if isinstance(value, list):
        return [instantiate(v) for v in value]
    return value


def build_schedule(spec: Any, num_speculative_tokens: int, args: Mapping | None = None) -> Any:
    """`method.schedule` + `method.schedule_args` -> a schedule object: a name is a file of
    conf/method/schedule/ (or of a folder on `hydra.searchpath`), called with `num_speculative_tokens`."""
    return build("method/schedule", spec, "schedule", args, num_speculative_tokens=num_speculative_tokens)


def build_verifier(spec: Any, args: Mapping | None = None) -> Any:
    """`method.verifier` + `method.verifier_args` -> a verifier object, or a `ByTemperature` rule that
    the decoder resolves for each generation's temperature: a name is a file of conf/method/verifier/."""
    from specdec.core.verify import ByTemperature

    verifier = build("method/verifier", spec, "verifier", args)
    if isinstance(verifier, ByTemperature) and isinstance(spec, str):
        verifier.label = f"verifier={spec}"
    return verifier
