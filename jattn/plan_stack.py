"""Stacking per-device plans into one for data parallelism (:func:`stack_plans`): the
plans' arrays concatenated along their leading axis, split again by ``shard_map`` inside
:class:`jattn.sharding.DataParallelMLABackend` and the models' data-parallel step."""

from __future__ import annotations

import dataclasses

import numpy as np

from jattn.metadata import DecodeMetadata, ExtendMetadata

__all__ = ["stack_plans"]


def stack_plans(plans):
    """One plan for data parallelism: the per-device plans (one per device of the axis,
    in mesh order, all ``DecodeMetadata`` or all ``ExtendMetadata``, planned with the same
    buckets so that their arrays have the same shapes) concatenated along their leading
    axis (``num_reqs`` becomes ``i32[n]``). Page ids and slots stay local to each device's
    pool. Static fields must agree, except an extend's ``has_prefix`` (True if any is) and
    ``max_seqlen_q`` (the largest: a bound). ``positions`` comes out flat, as a model reads it;
    a cascade plan's ``prefix_pages`` (data, per device) is concatenated like the other arrays."""
    plans = list(plans)
    if not plans:
        raise ValueError("stack_plans: plans is empty (one plan per device of the data-parallel axis)")
    cls = type(plans[0])
    if cls not in (DecodeMetadata, ExtendMetadata) or any(type(p) is not cls for p in plans):
        raise TypeError(
            "stack_plans: plans must all be DecodeMetadata or all ExtendMetadata, got "
            f"{[type(p).__name__ for p in plans]}"
        )
    statics = {}
    fields = [f.name for f in dataclasses.fields(cls)]
    for name in sorted(fields, key=lambda f: f in _DATA_FIELDS):  # statics first: group_size before prefix_pages
        vals = [getattr(p, name) for p in plans]
        if name in _DATA_FIELDS:
            shapes = {np.shape(x) for x in vals}
            if len(shapes) != 1:
                raise ValueError(
                    f"stack_plans: {name} has shapes {sorted(shapes)} across the plans; plan every device "
                    "with the same batch_buckets, token_buckets and max_pages (one bucket each)"
                )
            continue
        if cls is ExtendMetadata and name == "has_prefix":
            statics[name] = any(vals)
        elif cls is ExtendMetadata and name == "max_seqlen_q":
            statics[name] = max(vals)
        elif any(x != vals[0] for x in vals):
            raise ValueError(f"stack_plans: the static field {name} differs across the plans: {vals}")
        else:
            statics[name] = vals[0]
    data = {
        name: None
        if getattr(plans[0], name) is None  # a plain plan's prefix_pages (group_size 1 in every plan)
        else np.concatenate([np.asarray(getattr(p, name)).reshape(-1, *np.shape(getattr(p, name))[1:]) for p in plans])
        for name in _DATA_FIELDS
        if name in fields
    }
    return cls(**data, **statics)


# The array fields (split along the axis inside shard_map); prefix_pages: a cascade plan's, per device.
_DATA_FIELDS = (
    "page_table",
    "cache_seqlens",
    "prefix_lens",
    "cu_seqlens_q",
    "out_cache_loc",
    "positions",
    "num_reqs",
    "prefix_pages",
)
