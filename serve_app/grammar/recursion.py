"""A recursive JSON Schema unfolded to a bounded depth of `$ref`s.

A schema whose `$ref`s form a cycle (a linked list, a tree, `{"child": {"$ref": "#"}}`) admits
answers of any depth, and a grammar of it lets a model nest for as long as it likes: a model
that keeps choosing the recursive branch (the embedded pair does, on KVV's linked-list cases)
spends all of `max_tokens` inside one argument and the answer is cut off, invalid. Unfolded to
a bounded depth, the deepest `$ref`s admit nothing, so past that depth only the branches that
end (`null`, an omitted optional property) remain and every answer that finishes is valid
against the original schema: the bounded schema's instances are a subset of the original's,
differing only in instances nested deeper than the bound.

Only documents whose references are all local JSON pointers (`#`, `#/...`) are unfolded, and
only when they have a cycle; anything else (`$id`-relative or anchor references,
`$dynamicRef`) is returned unchanged, as is a schema whose unfolding would be larger than
`max_bytes` (the caller compiles the original then).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

# Keys whose values are JSON data, not schemas: a {"$ref": ...} inside them is data.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})
# Keys whose values map names to schemas (a property called "$ref" is a schema, not a ref).
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "dependentSchemas", "$defs",
                          "definitions"})
_CONTAINERS = ("$defs", "definitions")
_DEFS_PREFIX = "k3_depth"


class _Unsatisfiable:
    """A subschema no instance can match (it reaches past the depth bound)."""


_UNSAT = _Unsatisfiable()


def bound_recursion(schema: Any, depth: int, max_bytes: int = 1 << 20) -> Any:
    """`schema` with every chain of more than `depth` `$ref`s cut (see module doc).

    A cut `$ref` matches nothing, and that is said in keywords the grammar compiler takes
    (llguidance refuses a `$ref` to `false`): an optional property that can match nothing is
    `false` (absent), an `anyOf` branch is dropped, array items that can match nothing leave
    the array empty; a required property, the last branch, or anything else that can match
    nothing makes its parent match nothing. Every cut only removes instances, so each instance
    of the result is one of `schema`'s."""
    if not isinstance(schema, dict):
        return schema
    refs = _refs(schema)
    if refs is None or not refs or not _has_cycle(schema, refs):
        return schema
    defs: dict[str, Any] = {}
    memo: dict[tuple[str, int], str | _Unsatisfiable] = {}
    size = 0

    def ref(pointer: str, level: int) -> str | _Unsatisfiable:
        """The definition `pointer` unfolds to at `level`, or _UNSAT."""
        nonlocal size
        if level > depth:
            return _UNSAT
        key = (pointer, level)
        if key not in memo:
            memo[key] = _UNSAT  # a cycle within one level cannot occur: refs go one deeper
            body = rewrite(_resolve(schema, pointer), level)
            if not isinstance(body, _Unsatisfiable):
                name = f"{_DEFS_PREFIX}_{level}_{refs[pointer]}"
                defs[name] = body
                size += len(json.dumps(body))
                if size > max_bytes:
                    raise _TooLarge
                memo[key] = name
        return memo[key]

    def rewrite(node: Any, level: int) -> Any:
        if isinstance(node, list):
            return [rewrite(item, level) for item in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _CONTAINERS and isinstance(value, dict):
                continue  # definitions are reached through refs, each at its own depth
            if key in _DATA_KEYS:
                out[key] = value
                continue
            if key == "$ref" and isinstance(value, str):
                target = ref(value, level + 1)
                if isinstance(target, _Unsatisfiable):
                    return _UNSAT
                out[key] = f"#/$defs/{target}"
            elif key == "properties" and isinstance(value, dict):
                required = node.get("required") if isinstance(node.get("required"), list) \
                    else []
                props = {}
                for name, sub in value.items():
                    sub = rewrite(sub, level)
                    if isinstance(sub, _Unsatisfiable):
                        if name in required:
                            return _UNSAT
                        sub = False
                    props[name] = sub
                out[key] = props
            elif key in ("anyOf", "oneOf") and isinstance(value, list):
                branches = [b for b in (rewrite(v, level) for v in value)
                            if not isinstance(b, _Unsatisfiable)]
                if not branches:
                    return _UNSAT
                out[key] = branches
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                sub = rewrite(value, level)
                if isinstance(sub, _Unsatisfiable):
                    if key == "items" and _positive(node.get("minItems")):
                        return _UNSAT
                    sub = False
                out[key] = sub
            else:
                sub = (
                    {k: rewrite(v, level) for k, v in value.items()}
                    if key in _SCHEMA_MAPS and isinstance(value, dict)
                    else rewrite(value, level))
                if _holds_unsat(sub):
                    return _UNSAT  # anywhere else, matching nothing cannot be said: cut it all
                out[key] = sub
        return out

    try:
        root = rewrite(schema, 0)
    except (_TooLarge, RecursionError):  # a schema the ingress let through, nested very deep
        return schema
    if isinstance(root, _Unsatisfiable):
        return schema
    return {**root, "$defs": defs} if defs else root


class _TooLarge(Exception):
    pass


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and value > 0


def _holds_unsat(value: Any) -> bool:
    """Whether a rewritten value is, or directly holds, a subschema that matches nothing. One
    level is enough: `rewrite` turns a schema that holds one into _UNSAT itself."""
    items = value if isinstance(value, list) else (
        value.values() if isinstance(value, dict) else (value,))
    return any(isinstance(item, _Unsatisfiable) for item in items)


_IDENTIFIERS = frozenset({"$id", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef"})


def _refs(schema: Any) -> dict[str, int] | None:
    """Each distinct `$ref` pointer in the document, numbered; None when any is not a local
    JSON pointer or when the document uses identifiers the pointers would be relative to."""
    found: dict[str, int] = {}
    for keyword, value in _keywords(schema, into_definitions=True):
        if keyword in _IDENTIFIERS:
            return None
        if not (value == "#" or value.startswith("#/")) or _resolve(schema, value) is None:
            return None
        found.setdefault(value, len(found))
    return found


def _keywords(node: Any, into_definitions: bool) -> Iterator[tuple[str, str]]:
    """The `$ref`s and identifiers in the schema `node` (inside its definitions too, when
    asked), never inside data (`enum`, `const`, ...) nor property names."""
    if isinstance(node, list):
        for item in node:
            yield from _keywords(item, into_definitions)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in _DATA_KEYS or (key in _CONTAINERS and not into_definitions):
            continue
        if (key == "$ref" or key in _IDENTIFIERS) and isinstance(value, str):
            yield key, value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            for item in value.values():
                yield from _keywords(item, into_definitions)
        else:
            yield from _keywords(value, into_definitions)


def _resolve(schema: Any, pointer: str) -> Any:
    """The node a local JSON pointer names (RFC 6901), or None."""
    node = schema
    for part in pointer[2:].split("/") if pointer != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _has_cycle(schema: Any, refs: dict[str, int]) -> bool:
    """Whether following `$ref`s from the root can come back to a pointer already on the path."""
    edges = {pointer: _direct_refs(_resolve(schema, pointer)) for pointer in refs}
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(pointer: str) -> bool:
        if state.get(pointer) == 1:
            return True
        if state.get(pointer) == 2:
            return False
        state[pointer] = 1
        if any(visit(nxt) for nxt in edges[pointer]):
            return True
        state[pointer] = 2
        return False

    return any(visit(pointer) for pointer in _direct_refs(schema))


def _direct_refs(node: Any) -> set[str]:
    """The pointers `node` refers to itself (not through definitions it merely contains)."""
    return {value for keyword, value in _keywords(node, into_definitions=False)
            if keyword == "$ref"}
