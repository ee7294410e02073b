"""Pytree helpers: attrs classes as torch pytree nodes, path-keyed flattening."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import attrs
import torch.utils._pytree as pytree

T = TypeVar("T")


def pytree_node(cls: type[T]) -> type[T]:
    """Register a frozen attrs class as a torch pytree node whose children are all its fields (in order)."""
    names = [a.name for a in attrs.fields(cls)]

    # ``None`` fields (an absent MTP block, a tied head) go into the context, not the leaves: the treespec then
    # records which optional sub-trees are absent (a different treespec for each).
    def present(obj):
        return [n for n in names if getattr(obj, n) is not None]

    def flatten(obj):
        keep = present(obj)
        return [getattr(obj, n) for n in keep], tuple(keep)

    def unflatten(children, ctx):
        values = dict.fromkeys(names)
        values.update(zip(ctx, children))
        return cls(**values)

    def flatten_with_keys(obj):
        keep = present(obj)
        return [(pytree.GetAttrKey(n), getattr(obj, n)) for n in keep], tuple(keep)

    pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )
    return cls


def path_str(path: tuple) -> str:
    """Render a pytree key path as a dotted string: ``layers.3.mixer.w_q``."""
    parts = []
    for k in path:
        if isinstance(k, pytree.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, pytree.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, pytree.MappingKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return ".".join(parts)


def named_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    """``[(dotted path, leaf)]`` in flatten order."""
    flat, _ = pytree.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(path_str(p), v) for p, v in flat]


def tree_map(fn: Callable, tree: Any, *rest: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    return pytree.tree_map(fn, tree, *rest, is_leaf=is_leaf)


def tree_map_with_path(fn: Callable[[str, Any], Any], tree: Any, is_leaf=None) -> Any:
    return pytree.tree_map_with_path(lambda p, x: fn(path_str(p), x), tree, is_leaf=is_leaf)


def tree_leaves(tree: Any, is_leaf=None) -> list[Any]:
    return pytree.tree_leaves(tree, is_leaf=is_leaf)
