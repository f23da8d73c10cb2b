"""What the runtime remembers between caches, in one place, forgotten with its owners.

    plans(bridge, device)               per target layer, its LayerMap ready for one device
    stacked_plan(bridge, layers, device)  several LayerMaps stacked for one grouped launch
    reading_graph(model, shape)         a captured reading of the model per shape bucket (4 kept)
    pass_graph(target, shape, make)     a captured native-work pass per shape bucket (3 kept)
    rope_on(tables, device)             rotary tables moved to a device (cos/sin computed there)
    source_rope(spec)                   a bridge's source rotary tables, rebuilt from its spec
    key_norm_scales(target)             the target's key-norm scales, until a weight changes

Every entry is keyed weakly by the object it belongs to (a Bridge, a RopeTables, a model): it is
dropped with that object, and nothing is stored on the caller's objects.
"""

from __future__ import annotations

import weakref
from functools import lru_cache

import torch

from bridgecache.kv.keynorm import key_norm_scales as _key_norm_scales
from bridgecache.kv.rope import RopeTables
from bridgecache.runtime.graphs import PassGraph, ReadingGraph
from bridgecache.runtime.translate import LayerPlan, StackedPlan

__all__ = ["MEMO", "RuntimeMemo", "weights_version"]


def weights_version(model) -> tuple:
    """Identity, storage and autograd version of every parameter and buffer: changes when one is
    replaced or written in place through autograd-visible ops (optimizer steps, load_state_dict,
    merges under no_grad). Writes through `.data` bypass the version counter and are not seen."""
    # A plain walk of the module tree: `model.parameters()` builds names and a visited set for
    # every module, several times the host time on a 28-layer model.
    version, modules = [], [model]
    while modules:
        module = modules.pop()
        for tensors in (module._parameters, module._buffers):
            version.extend((id(t), t.data_ptr(), t._version) for t in tensors.values() if t is not None)
        modules.extend(m for m in module._modules.values() if m is not None)
    return tuple(version)


class _PerObject:
    """A dict keyed by object identity, each entry dropped when its object is collected (Bridges
    are dataclasses: equal by value, not hashable)."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, dict]] = {}

    def of(self, owner) -> dict:
        key = id(owner)
        entry = self._entries.get(key)
        if entry is None or entry[0]() is not owner:
            entry = (weakref.ref(owner, lambda _, key=key: self._entries.pop(key, None)), {})
            self._entries[key] = entry
        return entry[1]


class RuntimeMemo:
    """Per-object memos of the runtime (see the module docstring)."""

    def __init__(self):
        self._plans = _PerObject()  # Bridge -> {device: {layer: LayerPlan}}
        self._stacked = _PerObject()  # Bridge -> {(layers, device): StackedPlan}
        self._rope = _PerObject()  # RopeTables -> {device: RopeTables}
        self._norms = _PerObject()  # model -> {"weights": version, "scales": scales}
        self._readings = _PerObject()  # model -> {(batch, queries, capacity, reduce): ReadingGraph}
        self._passes = _PerObject()  # target -> {(batch, slots, capacity): PassGraph}

    def plan(self, bridge, layer: int, device: torch.device):
        plans = self._plans.of(bridge).setdefault(device, {})
        if layer not in plans:
            plans[layer] = LayerPlan.build(bridge.layers[layer], bridge.source.num_kv_heads, device)
        return plans[layer]

    def stacked_plan(self, bridge, layers: tuple[int, ...], device: torch.device):
        plans = self._stacked.of(bridge)
        if (layers, device) not in plans:
            plans[layers, device] = StackedPlan.build(
                bridge.layers, layers, bridge.source.num_kv_heads, device
            )
        return plans[layers, device]

    def rope_on(self, tables: RopeTables, device: torch.device) -> RopeTables:
        """`tables` with its rotary modules on `device`, so a context's cos/sin are computed there
        rather than on the CPU and copied (ms per 10K tokens)."""
        if next(tables.rotary.buffers(), torch.empty(0, device=device)).device == device:
            return tables
        copies = self._rope.of(tables)
        if device not in copies:
            copies[device] = tables.to(device)
        return copies[device]

    @staticmethod
    @lru_cache(maxsize=16)
    def source_rope(spec) -> RopeTables:
        """The rotary tables of a bridge's source spec (built once: it constructs a config and module)."""
        return RopeTables.from_spec(spec)

    def reading_graph(
        self, model, batch: int, queries: int, capacity: int, reduce: str, layers: int | None = None
    ) -> ReadingGraph:
        """The captured reading of `model` at this shape (the 4 most recent shapes per model kept:
        each holds a copy of a context's KV)."""
        graphs = self._readings.of(model)
        key = (batch, queries, capacity, reduce, layers)
        if key not in graphs:
            if len(graphs) >= 4:
                del graphs[next(iter(graphs))]
            graphs[key] = ReadingGraph(model, batch, queries, capacity, reduce, captured=True, layers=layers)
        graphs[key] = graphs.pop(key)  # most recent last
        return graphs[key]

    def pass_graph(self, target, shape: tuple, make) -> PassGraph:
        """The captured pass of `target` at `shape` (made by `make()` the first time; the 3 most
        recent shapes per target kept: each holds buffers of a whole cache)."""
        graphs = self._passes.of(target)
        if shape not in graphs:
            if len(graphs) >= 3:
                del graphs[next(iter(graphs))]
            graphs[shape] = make()
        graphs[shape] = graphs.pop(shape)
        return graphs[shape]

    def key_norm_scales(self, target):
        """keynorm.key_norm_scales(target), looked up again only when the target's weights changed
        (`weights_version`, a walk of the module tree); a target without key norms is remembered
        as such and costs nothing afterwards."""
        known = self._norms.of(target)
        if known.get("scales", ...) is None:  # no k_norm: the architecture does not change
            return None
        weights = weights_version(target)
        if known.get("weights") != weights:
            known.update(weights=weights, scales=_key_norm_scales(target))
        return known["scales"]


MEMO = RuntimeMemo()
