"""Partitioning rules of the flash attention calls (flash.py), on sharding.py's machinery.

* the batch and head axes keep their sharding, with no collective: each shard runs the kernels on
  its (batch, head) block, with a place table (_philox.place_table, as dropout_sharding.py's) where
  one of them is split, so that its dropout bits are the whole call's;
* the length and head_dim axes are whole on every shard (Shardy is told they need replication,
  GSPMD gets the operands with them whole): a query needs every key, and the causal rule and the
  bits read a query's position;
* the mask follows q on its full-size batch and head axes; the key words are replicated; lse and
  delta (B, H, Sq) follow q's batch and head axes.
"""

from __future__ import annotations

import functools

from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_softmax import _philox
from jax_softmax.sharding import (
    _first_sharding,
    _full_spec,
    _mesh_axes,
    _per_shard,
    _propagate_user_sharding,
    _replicated,
    _shapes_of,
    _shard_offset,
)

_WHOLE = ("sq", "d", "sk", "tq", "tk")  # factors that need replication (in the order they appear: Shardy asks)


def _mask_factors(shape, q_shape, sk):
    """The mask's factors: q's batch and head factors and the lengths where its axes are full, a
    factor of its own (unsharded) where they are 1 (a broadcast mask, or the dummy of no mask)."""
    full = (q_shape[0], q_shape[2], q_shape[1], sk)
    shared = ("b", "h", "sq", "sk")
    return tuple(f if n == m and m > 1 else f"m{i}" for i, (f, n, m) in enumerate(zip(shared, shape, full)))


def _sharding_rule(bwd: bool):
    """Operands (q, k, v, mask, tiles, key[, lse, dout, delta]); results (out, lse) or (dq, dk,
    dv)."""

    def rule(*args):
        shapes = _shapes_of(args[-2])
        q, kv, rows = ("b", "sq", "h", "d"), ("b", "sk", "h", "d"), ("b", "h", "sq")
        mask = _mask_factors(shapes[3], shapes[0], shapes[1][1])
        mappings = [q, kv, kv, mask, mask[:2] + ("tq", "tk"), ("kk", "kw")]
        if bwd:
            mappings += [rows, q, rows]
        results = (q, kv, kv) if bwd else (q, rows)
        return SdyShardingRule(tuple(mappings), results, need_replication_factors=_WHOLE)

    return rule


def _plan(mesh, arg_shapes):
    """(q's spec with its length and head_dim whole, the mesh axes that split batch and heads),
    or None where the sharding names no mesh."""
    q = arg_shapes[0]
    spec = _full_spec(q.sharding, 4)
    if spec is None or mesh is None or mesh.empty:
        return None
    spec = (spec[0], None, spec[2], None)
    split = tuple(tuple(a for a in _mesh_axes(spec[i]) if mesh.shape[a] > 1) for i in (0, 2))
    return spec, split


def _shardings(mesh, spec, arg_shapes, bwd: bool):
    batch, heads = arg_shapes[0].shape[0], arg_shapes[0].shape[2]
    qs = NamedSharding(mesh, PartitionSpec(*spec))
    rows = NamedSharding(mesh, PartitionSpec(spec[0], spec[2], None))
    m = arg_shapes[3].shape
    mask = NamedSharding(mesh, PartitionSpec(spec[0] if m[0] == batch else None,
                                             spec[2] if m[1] == heads else None, None, None))
    args = [qs, qs, qs, mask, mask, NamedSharding(mesh, PartitionSpec())]
    if bwd:
        args += [rows, qs, rows]
    results = [qs, qs, qs] if bwd else [qs, rows]
    return tuple(args), results


def _partitioned(kernel, bwd: bool):
    """The custom_partitioning op of one flash kernel primitive, called as
    ``op(*operands, scale, has_mask, causal, rate, broadcast)``."""
    num_operands = 9 if bwd else 6
    names = ("scale", "has_mask", "causal", "rate", "broadcast")

    def bind(operands, params, place=None):
        ops = list(operands)
        ops.insert(6, _philox.no_place() if place is None else place)
        return kernel().bind(*ops, **params)

    def local(*args):
        return bind(args[:num_operands], dict(zip(names, args[num_operands:])))

    def infer(*args):
        mesh, arg_shapes, _ = args[-3:]
        plan = _plan(mesh, arg_shapes)
        if plan is None:
            sharding = _first_sharding(mesh, arg_shapes)
            return [sharding] * (3 if bwd else 2)
        return _shardings(mesh, plan[0], arg_shapes, bwd)[1]

    def partition(*args):
        *static, mesh, arg_shapes, _ = args
        params = dict(zip(names, static))
        plan = _plan(mesh, arg_shapes)
        if plan is None:
            rep, arg_shardings = _replicated(arg_shapes)
            return mesh, _per_shard(lambda *ops: bind(ops, params)), [rep] * (3 if bwd else 2), arg_shardings
        spec, (batch_axes, head_axes) = plan
        arg_shardings, out_shardings = _shardings(mesh, spec, arg_shapes, bwd)
        if not (batch_axes or head_axes):
            return mesh, _per_shard(lambda *ops: bind(ops, params)), out_shardings, arg_shardings
        b, sq, h, _ = arg_shapes[0].shape
        sk = arg_shapes[1].shape[1]
        num_keys = arg_shapes[5].shape[0]

        @_per_shard
        def lower_fn(*ops):
            lb, _, lh, _ = ops[0].shape
            offsets = (_shard_offset(batch_axes, lb), _shard_offset(head_axes, lh), 0)
            place = _philox.place_table((lb, lh, sq, sk), (b, h, sq, sk), offsets, num_keys,
                                        broadcast=params["broadcast"])
            return bind(ops, params, place)

        return mesh, lower_fn, out_shardings, arg_shardings

    op = custom_partitioning(local, static_argnums=tuple(range(num_operands, num_operands + len(names))))
    op.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        propagate_user_sharding=_propagate_user_sharding,
        sharding_rule=_sharding_rule(bwd),
    )
    return op


def _kernel(name):
    from jax_softmax import flash

    return getattr(flash, name)


_fwd_cp = _partitioned(functools.partial(_kernel, "kernel_flash_fwd_p"), bwd=False)
_bwd_cp = _partitioned(functools.partial(_kernel, "kernel_flash_bwd_p"), bwd=True)


def partitioned_fwd(q, k, v, mask, tiles, key, *, scale, has_mask, causal, rate, broadcast):
    """flash_fwd_p's lowering: the kernels per shard (placed where batch or heads are split)."""
    return _fwd_cp(q, k, v, mask, tiles, key, scale, has_mask, causal, rate, broadcast)


def partitioned_bwd(q, k, v, mask, tiles, key, lse, dout, delta, *, scale, has_mask, causal, rate,
                    broadcast):
    """flash_bwd_p's lowering, as partitioned_fwd."""
    return _bwd_cp(q, k, v, mask, tiles, key, lse, dout, delta, scale, has_mask, causal, rate,
                   broadcast)
