"""Partitioning rules of the attention-dropout calls (dropout.py), on sharding.py's machinery.

A dropout call's bits depend on each element's place in the whole array (ffi/philox.h: the key,
the dense row index, the column), so a shard must know where its rows lie. The rules:

* the key (softmax) axis is never split: Shardy is told it needs replication, GSPMD gets the
  operands with it whole (the partitioner gathers a key-sharded input along that axis only);
* every other axis keeps its sharding, with no collective. A shard whose rows are the whole
  array's (no leading axis split) runs the fused kernel as an unsharded call does. A shard of a
  split batch, head or query axis runs it too, with a place table (_philox.place_table: per
  local row its key, counter index and query position in the whole array, computed on the
  device from jax.lax.axis_index times the block size per axis): the same bits and causal
  limits as the whole call;
* bias and mask are sharded like the scores on their full-size axes and stay whole on their
  broadcast ones; the (K, 2) key operand is replicated; the row log-sum-exp (the forward's second
  result, the backward's operand) is sharded like the scores' rows.

On one device and inside shard_map the kernel call is inlined, as for the softmax calls.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_softmax import _philox
from jax_softmax.sharding import (
    _first_sharding,
    _follow,
    _full_spec,
    _mesh_axes,
    _operand_factors,
    _per_shard,
    _propagate_user_sharding,
    _replicated,
    _shapes_of,
    _shard_offset,
)

# The Shardy factor of the key (softmax) axis: named apart so that it can need replication.
_KEY_FACTOR = "keys"


def _sharding_rule(num_results: int):
    """Shardy rule of a call whose operands are (scores, bias, mask, key[, lse, dy]): the scores'
    leading axes are factors d0 ... that full-size axes of the other operands share (size-1 ones
    get factors of their own), the last axis the factor `keys`, which needs replication; the key
    operand has factors of its own; lse maps to the leading factors. Results: (out, lse) or
    (dx,)."""

    def rule(*args):
        shapes = _shapes_of(args[-2])
        first = shapes[0]
        factors = tuple(f"d{i}" for i in range(len(first) - 1)) + (_KEY_FACTOR,)
        mappings = []
        for k, shape in enumerate(shapes):
            if k == 3:  # the (K, 2) key words
                mappings.append(("key_k", "key_w"))
            elif k == 4:  # the backward's lse
                mappings.append(factors[:-1])
            else:
                mappings.append(_operand_factors(factors, shape, first, k))
        results = (factors,) + ((factors[:-1],) if num_results == 2 else ())
        return SdyShardingRule(tuple(mappings), results, need_replication_factors=(_KEY_FACTOR,))

    return rule


def _specs(mesh, arg_shapes):
    """(spec of the scores with the key axis whole, per-axis mesh axes that split the leading
    axes) or None where the sharding names no mesh."""
    first = arg_shapes[0]
    ndim = len(first.shape)
    spec = _full_spec(first.sharding, ndim)
    if spec is None or mesh is None or mesh.empty:
        return None
    spec = spec[:-1] + (None,)
    split = tuple(tuple(a for a in _mesh_axes(e) if mesh.shape[a] > 1) for e in spec[:-1])
    return spec, split


def _arg_shardings(mesh, spec, arg_shapes):
    first = arg_shapes[0].shape
    out = []
    for k, a in enumerate(arg_shapes):
        if k == 3:  # the key words
            out.append(NamedSharding(mesh, PartitionSpec()))
        elif k == 4:  # the backward's lse
            out.append(NamedSharding(mesh, PartitionSpec(*spec[:-1])))
        else:
            out.append(NamedSharding(mesh, _follow(spec, a.shape, first)))
    return tuple(out)


def _result_shardings(mesh, spec, num_results: int):
    out = NamedSharding(mesh, PartitionSpec(*spec))
    if num_results == 1:
        return out
    return [out, NamedSharding(mesh, PartitionSpec(*spec[:-1]))]  # a list: custom_partitioning's type


def _partitioned(kernel, param_names: tuple[str, ...], num_operands: int, num_results: int):
    """The custom_partitioning op of one dropout kernel primitive, called as
    ``op(*operands, *params)``. `kernel` is the kernel primitive's getter."""

    def bind(operands, params, place=None):
        return kernel().bind(*operands, _philox.no_place() if place is None else place, **params)

    def local(*args):
        return bind(args[:num_operands], dict(zip(param_names, args[num_operands:])))

    def infer(*args):
        mesh, arg_shapes, _ = args[-3:]
        plan = _specs(mesh, arg_shapes)
        if plan is None:  # no mesh to name, or a sharding GSPMD does not know yet
            sharding = _first_sharding(mesh, arg_shapes)
            return sharding if num_results == 1 else [sharding] * 2
        return _result_shardings(mesh, plan[0], num_results)

    def partition(*args):
        *static, mesh, arg_shapes, _ = args
        params = dict(zip(param_names, static))
        plan = _specs(mesh, arg_shapes)
        if plan is None:
            rep, arg_shardings = _replicated(arg_shapes)
            out = rep if num_results == 1 else [rep, rep]
            return mesh, _per_shard(lambda *ops: bind(ops, params)), out, arg_shardings
        spec, split = plan
        arg_shardings = _arg_shardings(mesh, spec, arg_shapes)
        out_shardings = _result_shardings(mesh, spec, num_results)
        if not any(split):
            return mesh, _per_shard(lambda *ops: bind(ops, params)), out_shardings, arg_shardings
        global_shape = tuple(arg_shapes[0].shape)
        num_keys = arg_shapes[3].shape[0]

        @_per_shard
        def lower_fn(*ops):
            local_shape = ops[0].shape
            offsets = [_shard_offset(axes, n) for axes, n in zip(split, local_shape[:-1])]
            place = _philox.place_table(local_shape, global_shape, offsets, num_keys,
                                        broadcast=params["broadcast"])
            return bind(ops, params, place)

        return mesh, lower_fn, out_shardings, arg_shardings

    op = custom_partitioning(local, static_argnums=tuple(range(num_operands, num_operands + len(param_names))))
    op.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        propagate_user_sharding=_propagate_user_sharding,
        sharding_rule=_sharding_rule(num_results),
    )
    return op


_PARAMS = ("scale", "has_bias", "has_mask", "causal", "rate", "broadcast")


def _kernel(name):
    from jax_softmax import dropout

    return getattr(dropout, name)


_fwd_cp = _partitioned(functools.partial(_kernel, "kernel_dropout_fwd_p"), _PARAMS, num_operands=4,
                       num_results=2)
_bwd_cp = _partitioned(functools.partial(_kernel, "kernel_dropout_bwd_p"), _PARAMS + ("grad_scale",),
                       num_operands=6, num_results=1)


def partitioned_fwd(x, bias, mask, key, *, scale, has_bias, has_mask, causal, rate, broadcast):
    """attn_dropout_fwd_p's lowering: the kernel per shard (placed where rows are split)."""
    return _fwd_cp(x, bias, mask, key, scale, has_bias, has_mask, causal, rate, broadcast)


def partitioned_bwd(x, bias, mask, key, lse, dy, *, scale, has_bias, has_mask, causal, rate,
                    broadcast, grad_scale):
    """attn_dropout_bwd_p's lowering, as partitioned_fwd."""
    return _bwd_cp(x, bias, mask, key, lse, dy, scale, has_bias, has_mask, causal, rate, broadcast,
                   grad_scale)
