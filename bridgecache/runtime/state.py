"""What one handoff engine keeps between requests, owned by it and freed by its `close()`.

    state = EngineState(bridge, source, target)
    state.plan(layer, device)                      a target layer's LayerMap ready for one device
    state.stacked_plan(layers, device)             several LayerMaps stacked for one grouped launch
    state.rope_on(tables, device)                  rotary tables moved to a device
    state.source_rope                              the bridge's source rotary tables (from its spec)
    state.key_norm_scales()                        the target's key-norm scales (runtime.identity
                                                   checks their weights per request)
    state.source_view / state.target_view          ModelViews that run our attention (runtime.views)
    state.graphs                                   captured CUDA graphs, bounded by bytes (LRU)
    state.route_costs(config) / set_route_costs    the cost gate's measured costs (bridgecache.runtime.route)

Nothing here is process-global and nothing is stored on the caller's objects: an engine's state
lives and dies with the engine (`close()` drops every tensor, graph and view it made).

Knows the runtime's plans, views and graphs; nothing about requests or tokenizers.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict

import torch

from bridgecache.kv.keynorm import key_norm_scales
from bridgecache.kv.rope import RopeTables
from bridgecache.runtime.inputs import saved_costs_for
from bridgecache.runtime.interop.attention import NAME
from bridgecache.runtime.interop.views import ModelView
from bridgecache.runtime.route import RouteCosts, device_name, load_costs, route_key
from bridgecache.runtime.translation.layers import LayerPlan, StackedPlan

__all__ = ["EngineState", "GraphStore"]


class GraphStore:
    """Captured CUDA graphs by key, least recently used dropped first, holding at most `budget`
    bytes of device memory in all (each graph's buffers and its capture pool, as measured when it
    was captured). A shape is captured on its second request (a capture costs about three eager
    forwards: a shape seen once runs eagerly), and only when its buffers take at most `share` of
    the budget: a quarter by default (a long prefill or pass is bound by its arithmetic, not its
    launches: it runs eagerly rather than evict); a reading asks for the whole budget (a few
    query tokens: launches bound it at every length, 7-16% GPU busy at 4K-32K on an H100,
    benchmarks/reports/route-gate-2026-12-05.md). A capture that fails (a forward that cannot be
    captured, such as a user's model that builds a tensor on the host) is reported once as a
    RuntimeWarning and its shape runs eagerly from then on."""

    SEEN = 1024  # shapes remembered as requested once

    def __init__(self, budget: int):
        self.budget = budget
        self._graphs: OrderedDict = OrderedDict()  # key -> (graph, bytes)
        self._seen: OrderedDict = OrderedDict()  # keys requested once, not captured
        self._failed: set = set()  # keys whose capture raised: eager from then on
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self._graphs.values())

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, key, make, expected_bytes: int, share: float = 0.25):
        """The graph under `key`, made by `make()` the first time; None when `expected_bytes`
        (its buffers, before capture) exceed `share` of the budget."""
        with self._lock:
            if key in self._graphs:
                self._graphs.move_to_end(key)
                return self._graphs[key][0]
            if expected_bytes > share * self.budget or key in self._failed:
                return None
            if key not in self._seen:
                self._seen[key] = None
                while len(self._seen) > self.SEEN:
                    self._seen.popitem(last=False)
                return None
            del self._seen[key]
            self._make_room(expected_bytes)
        device = torch.cuda.current_device()
        before = torch.cuda.memory_reserved(device)
        try:
            graph = make()
        except RuntimeError as error:  # the same forward runs eagerly: the request is not lost
            with self._lock:
                self._failed.add(key)
            message = f"CUDA graph capture of {key} failed, running it eagerly: {error}"
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            return None
        size = max(expected_bytes, torch.cuda.memory_reserved(device) - before)
        with self._lock:
            self._make_room(size)
            self._graphs[key] = (graph, size)
        return graph

    def _make_room(self, size: int) -> None:
        while self._graphs and self.nbytes + size > self.budget:
            self._graphs.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()
            self._seen.clear()
            self._failed.clear()


class EngineState:
    """The per-engine memos of the runtime (see the module docstring).

    graph_bytes: the budget of captured CUDA graphs (device memory beyond the models and caches).
    """

    def __init__(self, bridge, source, target, *, graph_bytes: int):
        self.bridge = bridge
        self._source, self._target = source, target
        self._plans: dict = {}  # (layer, device) -> LayerPlan
        self._stacked: dict = {}  # (layers, device) -> StackedPlan
        self._rope: dict = {}  # (id(tables), device) -> RopeTables
        self._views: dict = {}  # id(model) -> its ModelView
        self._lock = threading.Lock()
        self.replay_lock = threading.RLock()  # a captured graph's buffers serve one request at a time
        self.source_rope = RopeTables.from_spec(bridge.source)
        self._norms = key_norm_scales(target) if target is not None else None
        self.graphs = GraphStore(graph_bytes)
        self._route_costs: dict = {}  # route_key -> RouteCosts or None (nothing saved)
        self._route_keys: dict = {}  # HandoffConfig -> its route_key

    # ------------------------------------------------------------------ plans and tables
    def plan(self, layer: int, device: torch.device) -> LayerPlan:
        key = (layer, device)
        if key not in self._plans:
            plan = LayerPlan.build(self.bridge.layers[layer], self.bridge.source.num_kv_heads, device)
            with self._lock:
                self._plans.setdefault(key, plan)
        return self._plans[key]

    def stacked_plan(self, layers: tuple[int, ...], device: torch.device) -> StackedPlan:
        key = (layers, device)
        if key not in self._stacked:
            plan = StackedPlan.build(self.bridge.layers, layers, self.bridge.source.num_kv_heads, device)
            with self._lock:
                self._stacked.setdefault(key, plan)
        return self._stacked[key]

    def rope_on(self, tables: RopeTables, device: torch.device) -> RopeTables:
        """`tables` with its rotary modules on `device`, so a context's cos/sin are computed there
        rather than on the CPU and copied (ms per 10K tokens)."""
        if next(tables.rotary.buffers(), torch.empty(0, device=device)).device == device:
            return tables
        key = (id(tables), device)
        if key not in self._rope:
            with self._lock:
                self._rope.setdefault(key, tables.to(device))
        return self._rope[key]

    def key_norm_scales(self):
        """The target's key-norm scales (None: it normalises no keys), computed when the engine was
        built (the engine's per-request identity check refuses a request after their weights
        changed: runtime.identity)."""
        return self._norms

    # ------------------------------------------------------------------ the cost gate
    def route_key(self, config) -> str:
        """`route.route_key` of this setup under `config`, memoised per config (hashing the specs
        takes ~0.1 ms: a share of a short handoff's time)."""
        try:
            key = self._route_keys.get(config)
        except TypeError:  # a config holding an unhashable selector: computed each time
            return route_key(self.bridge, self._source, self._target, config)
        if key is None:
            key = route_key(self.bridge, self._source, self._target, config)
            with self._lock:
                if len(self._route_keys) >= 64:  # bounded: configs are few in practice
                    self._route_keys.clear()
                self._route_keys[config] = key
        return key

    def route_costs(self, config) -> RouteCosts | None:
        """The measured costs of this setup under `config` on this device: the ones this state
        measured or loaded, else those saved in the cache directory, else None."""
        key = self.route_key(config)
        if key not in self._route_costs:
            costs = saved_costs_for(load_costs(key), key, device_name(self._target))
            with self._lock:
                self._route_costs.setdefault(key, costs)
        return self._route_costs[key]

    def set_route_costs(self, costs: RouteCosts) -> None:
        with self._lock:
            self._route_costs[costs.key] = costs

    # ------------------------------------------------------------------ views
    def view(self, role: str) -> ModelView:
        """The ModelView of the source or the target, made on first use."""
        model = self._source if role == "source" else self._target
        if model is None:
            raise ValueError(f"this engine has no {role} model")
        return self.view_of(model)

    def view_of(self, model) -> ModelView:
        """The ModelView of `model` (one of this state's models, or another a cache was given),
        made on first use."""
        entry = self._views.get(id(model))
        if entry is None or entry.original is not model:
            with self._lock:
                entry = self._views[id(model)] = ModelView(model, NAME)
        return entry

    # ------------------------------------------------------------------ ownership
    @property
    def device_bytes(self) -> int:
        """Device (CUDA) bytes this state holds: plans, rope copies and graphs."""
        tensors = [t for plan in (*self._plans.values(), *self._stacked.values()) for t in _tensors(plan)]
        held = sum(t.numel() * t.element_size() for t in tensors if t.is_cuda)
        return held + self.graphs.nbytes

    def clear(self) -> None:
        """Forget everything made since the engine was built (it is made again on demand)."""
        with self._lock:
            self.graphs.clear()
            self._plans.clear()
            self._stacked.clear()
            self._rope.clear()
            self._views.clear()
            self._route_costs.clear()
            self._route_keys.clear()


def _tensors(plan) -> list[torch.Tensor]:
    values = vars(plan).values() if hasattr(plan, "__dict__") else ()
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found
