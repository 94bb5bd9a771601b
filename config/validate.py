"""Validation of configuration data: one clear message per refusal.

`validate` takes data shaped like `DEFAULTS` (the defaults merged with a file
and overrides, unknown keys kept so they can be reported) and raises one
`ConfigError` at the first problem, checking sections in file order. Every
message has the same shape:

    <source>: <dotted key> = <value as TOML> <what is wrong>; <what is allowed or what to do>

for example

    config/prod.toml: broker.lanes = [64, 256, 128] is not strictly increasing
    (256 is followed by 128); expected a non-empty list of token counts ...

Checks in order: unknown sections and keys (with the closest allowed name),
types (an int is accepted where a float is; a bool is never a number), each
value against its rule in `config/rules.py`, then the rules that span keys: unique model names
and aliases (an alias is no model's name and no other model's alias),
`max_tokens` within the largest lane, local workers (`[workers]` or one `[[workers]]` table
per model) naming served models, no two stages on one address, and the
broker's key (`security.server_key`) only together with `security.authorized_keys`.
Whether a bind may listen beyond loopback is judged when the broker starts
(`pipeline/transport/security.py`), since client commands read the same file.
"""

import datetime
import difflib
import json
import re
from collections.abc import Callable, Mapping, Set
from typing import Any

from config.defaults import DEFAULTS, MODEL_DEFAULTS, REQUIRED, SECTIONS
from config.rules import (
    ADDRESS,
    FLEET_RULES,
    HTTP_ADDRESS,
    MODEL_RULES,
    RULES,
    WORKER_GROUP_RULES,
    Rule,
    clash,
)
from pipeline.core.errors import ConfigError


def validate(data: Mapping[str, Any], source: str, overridden: Set[str] = frozenset()) -> None:
    """Raise one ConfigError for the first problem in `data`, else return None.

    `data` is shaped like `DEFAULTS`; `source` names the file (or
    "<defaults>"); `overridden` holds the dotted keys ("broker.lanes",
    "models", or a whole section "broker") that came from overrides, so their
    messages say "overrides" instead of the file.
    """

    def where(key: str) -> str:
        head = re.split(r"[.\[]", key, maxsplit=1)[0]
        return "overrides" if key in overridden or head in overridden else source

    for name, value in data.items():
        if name not in DEFAULTS:
            raise ConfigError(f"{where(name)}: {_unknown_top(name, value)}")
    for section in SECTIONS:
        table = data[section]
        if section == "workers" and isinstance(table, list):
            continue  # [[workers]] tables: checked with the models they name
        if not isinstance(table, dict):
            raise _refuse(
                where(section),
                section,
                table,
                f"has the wrong type ({_describe(table)})",
                f"expected a table [{section}]",
            )
        _check_table(table, f"[{section}]", f"{section}.", RULES, where)
    _check_models(data["models"], data["broker"]["lanes"], where)
    _check_workers(data["workers"], [m["name"] for m in data["models"]], where)
    _check_fleet(data["fleet"], [m["name"] for m in data["models"]], where)
    _check_addresses(data, where)
    _check_security(data["security"], where)


def _check_table(
    table: Mapping[str, Any],
    label: str,
    prefix: str,
    rules: Mapping[str, Rule],
    where: Callable[[str], str],
) -> None:
    allowed = [k.removeprefix(prefix) for k in rules if k.startswith(prefix)]
    for key, value in table.items():
        if key not in allowed:
            hint = _suggest(key, allowed, prefix)
            raise ConfigError(
                f"{where(prefix + key)}: unknown key {prefix}{key} = {show(value)}; "
                f"allowed keys in {label}: {', '.join(allowed)}{hint}"
            )
    for key, value in table.items():
        rule = rules[prefix + key]
        if not rule.accepts(value):
            raise _refuse(
                where(prefix + key),
                prefix + key,
                value,
                f"has the wrong type ({_describe(value)})",
                f"expected {rule.allowed}",
            )
        problem = rule.problem(value)
        if problem:
            raise _refuse(
                where(prefix + key), prefix + key, value, problem, f"expected {rule.allowed}"
            )


def _check_models(models: Any, lanes: list[int], where: Callable[[str], str]) -> None:
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise _refuse(
            where("models"),
            "models",
            models,
            f"has the wrong type ({_describe(models)})",
            "expected an array of tables, written [[models]]",
        )
    if not models:
        raise _refuse(
            where("models"),
            "models",
            models,
            "is empty",
            "add at least one [[models]] table with a name and an engine",
        )
    seen: dict[str, int] = {}
    for i, table in enumerate(models):
        prefix = f"models[{i}]."
        rules = {prefix + key: rule for key, rule in MODEL_RULES.items()}
        _check_table(table, "[[models]]", prefix, rules, where)
        for key, default in MODEL_DEFAULTS.items():
            if default is REQUIRED and key not in table:
                raise ConfigError(
                    f"{where(prefix + key)}: models[{i}] has no {key}; every [[models]] table "
                    f"needs name and engine ({key}: {MODEL_RULES[key].allowed})"
                )
        name = table["name"]
        if name in seen:
            raise _refuse(
                where(prefix + "name"),
                prefix + "name",
                name,
                f"repeats models[{seen[name]}].name",
                "give each model a unique name",
            )
        seen[name] = i
        max_tokens = table.get("max_tokens", MODEL_DEFAULTS["max_tokens"])
        if max_tokens > lanes[-1]:
            default = "" if "max_tokens" in table else " (the default)"
            raise _refuse(
                where(prefix + "max_tokens"),
                prefix + "max_tokens",
                max_tokens,
                f"{default} exceeds the largest lane in broker.lanes ({lanes[-1]})",
                f"set {prefix}max_tokens to {lanes[-1]} or less, or add a lane >= {max_tokens}",
            )
    _check_aliases(models, seen, where)


def _check_aliases(models: list[dict], names: dict[str, int], where: Callable[[str], str]) -> None:
    """Each alias names one model: not another model's name, nor an alias of another model."""
    owner: dict[str, int] = {}
    for i, table in enumerate(models):
        key = f"models[{i}].aliases"
        for alias in table.get("aliases", ()):
            j = names.get(alias, owner.get(alias))
            if j is not None:
                other = "the name" if alias in names else "an alias"
                label = (
                    "its own name" if j == i else f"{other} of models[{j}] ({models[j]['name']})"
                )
                raise _refuse(
                    where(key),
                    key,
                    table["aliases"],
                    f"has {show(alias)}, which is {label}",
                    "remove it from the aliases"
                    if j == i
                    else "a name answers for one model only: remove it here or there",
                )
            owner[alias] = i


def _check_workers(workers: Any, models: list[str], where: Callable[[str], str]) -> None:
    """[workers] names a served model (or ""); each [[workers]] table names one, once."""
    if isinstance(workers, dict):
        if workers["model"] and workers["model"] not in models:
            raise _refuse(
                where("workers.model"),
                "workers.model",
                workers["model"],
                "names no [[models]] table",
                f'name one of {", ".join(models)}, or "" for the first',
            )
        return
    if not all(isinstance(w, dict) for w in workers):
        raise _refuse(
            where("workers"),
            "workers",
            workers,
            f"has the wrong type ({_describe(workers)})",
            "expected a [workers] table or [[workers]] tables, one per model",
        )
    _check_model_tables(
        workers,
        "workers",
        WORKER_GROUP_RULES,
        models,
        where,
        f"every [[workers]] table names the model it serves: one of {', '.join(models)}",
        "give each model one [[workers]] table (its count sets how many processes)",
    )


def _check_model_tables(
    tables: list[dict],
    name: str,
    table_rules: Mapping[str, Any],
    models: list[str],
    where: Callable[[str], str],
    fix_missing: str,
    fix_repeated: str,
) -> None:
    """Each of the [[NAME]] tables `tables` follows `table_rules` and names a served model,
    one table per model (the [[workers]] and [[fleet]] tables)."""
    seen: dict[str, int] = {}
    for i, table in enumerate(tables):
        prefix = f"{name}[{i}]."
        rules = {prefix + key: rule for key, rule in table_rules.items()}
        _check_table(table, f"[[{name}]] (table {i + 1})", prefix, rules, where)
        model = table.get("model", "")
        if model not in models:
            raise _refuse(
                where(prefix + "model"),
                prefix + "model",
                model,
                "names no [[models]] table" if model else "is missing or empty",
                fix_missing,
            )
        if model in seen:
            raise _refuse(
                where(prefix + "model"),
                prefix + "model",
                model,
                f"repeats {name}[{seen[model]}].model",
                fix_repeated,
            )
        seen[model] = i


def _check_fleet(fleet: Any, models: list[str], where: Callable[[str], str]) -> None:
    """Each [[fleet]] table names a served model, once, with min <= max (run.py fleet)."""
    if not isinstance(fleet, list) or not all(isinstance(t, dict) for t in fleet):
        raise _refuse(
            where("fleet"),
            "fleet",
            fleet,
            f"has the wrong type ({_describe(fleet)})",
            "expected an array of tables, written [[fleet]]",
        )
    _check_model_tables(
        fleet,
        "fleet",
        FLEET_RULES,
        models,
        where,
        f"every [[fleet]] table names the model its actors serve: one of {', '.join(models)}",
        "give each model one [[fleet]] table (min and max bound its actors)",
    )
    for i, table in enumerate(fleet):
        prefix = f"fleet[{i}]."
        low, high = table.get("min", 0), table.get("max", 1)
        if low > high:
            raise _refuse(
                where(prefix + "min"),
                prefix + "min",
                low,
                f"is above {prefix}max = {high}",
                "set min <= max (the fewest and the most actors of this model)",
            )


def _check_addresses(data: Mapping[str, Any], where: Callable[[str], str]) -> None:
    bound: dict[str, tuple[str, str]] = {}  # dotted key -> (address, as written), keys so far
    for key, rule in RULES.items():
        if rule is not ADDRESS and rule is not HTTP_ADDRESS:
            continue
        section, name = key.split(".")
        written = data[section][name]
        if rule is HTTP_ADDRESS and not written:
            continue  # no endpoint
        address = "tcp://" + written if rule is HTTP_ADDRESS else written  # the port it takes
        for other, (taken, shown) in bound.items():
            if clash(address, taken):
                raise _refuse(
                    where(key),
                    key,
                    written,
                    f"clashes with {other} = {show(shown)}",
                    "give each stage its own address",
                )
        bound[key] = (address, written)


def _check_security(security: Mapping[str, Any], where: Callable[[str], str]) -> None:
    """The broker's key and the directory of allowed client keys go together."""
    for key, other in (("server_key", "authorized_keys"), ("authorized_keys", "server_key")):
        if security[key] and not security[other]:
            raise _refuse(
                where(f"security.{key}"),
                f"security.{key}",
                security[key],
                f"is set but security.{other} is not",
                "set both (the broker's NAME.key_secret and a directory of allowed *.key "
                "files; docs/operations.md, Keys and authentication) or neither",
            )


def _refuse(where: str, key: str, value: Any, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{where}: {key} = {show(value)} {problem.strip()}; {fix}")


def _unknown_top(name: str, value: Any) -> str:
    if isinstance(value, dict):
        sections = ", ".join(f"[{s}]" for s in SECTIONS)
        close = difflib.get_close_matches(name, SECTIONS, n=1)
        hint = f"; did you mean [{close[0]}]?" if close else ""
        return f"unknown section [{name}]; allowed sections: {sections} and [[models]]{hint}"
    homes = [s for s in SECTIONS if name in DEFAULTS[s]]
    hint = f"; did you mean {homes[0]}.{name}?" if homes else ""
    return f"unknown top-level key {name} = {show(value)}; keys belong in a [section]{hint}"


def _suggest(key: str, allowed: list[str], prefix: str) -> str:
    """'; did you mean X?' from the same table, else the section that has this key."""
    close = difflib.get_close_matches(key, allowed, n=1)
    if close:
        return f"; did you mean {prefix}{close[0]}?"
    homes = [
        s
        for s in SECTIONS
        if key in DEFAULTS[s] and not prefix.startswith(("models", "workers[", "fleet["))
    ]
    return f"; did you mean {homes[0]}.{key}?" if homes else ""


def _describe(value: Any) -> str:
    """Name the TOML type of `value`: 'a boolean', 'a list containing a string'."""
    if isinstance(value, list):
        inner = {_describe(v) for v in value}
        return "a list containing " + " and ".join(sorted(inner)) if inner else "an empty list"
    for cls, name in (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a float"),
        (str, "a string"),
        (dict, "a table"),
        (datetime.date, "a date"),
        (datetime.time, "a time"),
    ):
        if isinstance(value, cls):
            return name
    return type(value).__name__


def show(value: Any, limit: int = 120) -> str:
    """Render `value` the way it would be written in TOML, cut at `limit` characters."""
    text = _toml(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    return repr(value)
