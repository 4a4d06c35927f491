"""Validate the workflow config against config/schema.yaml, with short messages.

Replaces ``snakemake.utils.validate``, which prints the whole schema after the
one useful line; defaults are filled in the same way (``set_default=True``).
Needs only jsonschema and PyYAML, which Snakemake itself depends on, so
common.smk can import it while it parses the workflow.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import yaml

from attnlab.config.checks import ConfigError


def validate_config(config: dict, schema_path: str | Path) -> None:
    """Fill defaults into ``config`` in place and raise ConfigError on the first problem."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    coerce_strings(config, schema, schema)
    validator = _with_defaults(jsonschema.Draft202012Validator)(schema)
    # best_match drains every error, so every default is filled even when one key is wrong
    error = jsonschema.exceptions.best_match(validator.iter_errors(config))
    if error is not None:
        raise ConfigError(describe(error))


def _with_defaults(validator_class):
    """A validator that fills each property's ``default`` before checking it (jsonschema FAQ)."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema:
                    instance.setdefault(name, copy.deepcopy(subschema["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


def describe(error: jsonschema.ValidationError) -> str:
    """Which key is wrong, what the schema rule says, and for an unknown key the allowed ones."""
    where = _dotted(error.absolute_path)
    rule = ".".join(str(part) for part in error.absolute_schema_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = sorted(error.schema.get("properties", {}))
        unknown = [key for key in error.instance if key not in allowed]
        keys = ", ".join(_dotted([*error.absolute_path, key]) for key in unknown)
        return (f"unknown config key {keys}: {error.message} (schema rule: {rule}). "
                f"Allowed keys under {where}: {', '.join(allowed)}. Fix the spelling or remove it.")
    if "propertyNames" in error.absolute_schema_path:
        where = f"a name under {where}"
    message = f"config key {where}: {error.message} (schema rule: {rule})."
    description = error.schema.get("description") if isinstance(error.schema, dict) else None
    if description:
        message += f" The schema says: {' '.join(str(description).split())}"
    return message


def _dotted(path) -> str:
    parts = [f"[{part}]" if isinstance(part, int) else f".{part}" for part in path]
    return "".join(parts).lstrip(".") or "(top level)"


# ---- command-line overrides ----
# `snakemake --config generation='{max_new_tokens: 64}'` reads the value with YAML's
# BaseLoader, so every nested scalar arrives as a string ('64'). Values the schema
# does not allow to be strings are read again with safe_load ('64' -> 64, 'null' -> None).


def coerce_strings(value, schema: dict, root: dict):
    """``value`` with string scalars re-read as YAML where the schema rules out a string."""
    schema = _resolve(schema, root)
    if isinstance(value, str):
        types = _types(schema, root)
        if not types or "string" in types:
            return value
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        return value if isinstance(parsed, str) else parsed
    if isinstance(value, dict):
        for key in value:
            child = _property_schema(schema, key)
            if child is not None:
                value[key] = coerce_strings(value[key], child, root)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value[:] = [coerce_strings(item, schema["items"], root) for item in value]
    return value


def _resolve(schema: dict, root: dict) -> dict:
    """Follow local ``$ref``s ("#/$defs/name"); keys beside a ``$ref`` win."""
    while isinstance(schema, dict) and "$ref" in schema:
        target = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _property_schema(schema: dict, key: str) -> dict | None:
    if key in schema.get("properties", {}):
        return schema["properties"][key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null",
              list: "array", dict: "object"}


def _types(schema: dict, root: dict) -> set[str]:
    """JSON types a schema allows (empty when it does not say)."""
    schema = _resolve(schema, root)
    if "type" in schema:
        return {schema["type"]} if isinstance(schema["type"], str) else set(schema["type"])
    if "enum" in schema:
        return {JSON_TYPES.get(type(v), "object") for v in schema["enum"]}
    types = set()
    for branch in schema.get("oneOf", []) + schema.get("anyOf", []):
        types |= _types(branch, root)
    return types


class _UniqueKeys(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last)."""


def _mapping_without_repeats(loader: _UniqueKeys, node: yaml.MappingNode, deep: bool = False):
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(f"{loader.name}: key '{key}' is given twice in one mapping (lines "
                              f"{seen[key] + 1} and {key_node.start_mark.line + 1}); YAML would keep only "
                              "the second silently. Keep one of them")
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_repeats)


def check_unique_keys(paths: list[str | Path]) -> None:
    """Raise ConfigError naming the file, the key and both lines where a config file gives a key
    twice in one mapping (Snakemake's loader keeps the last silently)."""
    for path in paths:
        with open(path) as handle:
            loader = _UniqueKeys(handle)
            loader.name = str(path)
            try:
                loader.get_single_data()
            finally:
                loader.dispose()
