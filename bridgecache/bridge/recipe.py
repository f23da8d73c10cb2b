"""How a bridge is fitted (`FitConfig`), and the recipe a bridge records of it.

    FitConfig()                                    the defaults every entry point shares
    FitConfig(method="cachebridge", layers_k=2)    CacheBridge from the top-2 source layers
    FitConfig(num_sequences=4, seq_len=64)         a quick, poor fit (tests, smoke runs)

`fit_bridge`, `fit_layer_maps`, `refit`, `bridge_for` and `bridgecache fit` (whose flags are made
from the fields) take one FitConfig, validated once where it is built. A fitted bridge records it
in `calibration["recipe"]` beside the two model names (`config.recipe(source, target)`: every
field that changes the maps); `FitConfig.from_recipe(recipe)` reads one back (recipes written
before FitConfig have the same keys; a key they lack takes its default) and `recipe_command`
writes the `bridgecache fit` command that makes the bridge again.

It lives beside the file format because every fitted bridge file carries a recipe. Knows option
names, ranges and flags; nothing about models or statistics.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import shlex
from dataclasses import dataclass

from bridgecache.kernels.stats import PRECISIONS as KERNEL_PRECISIONS
from bridgecache.models.spec import SPEC_LIMITS
from bridgecache.text import UserText, user_text
from tokenalign import POLICIES

__all__ = [
    "FitConfig",
    "FitOptionError",
    "RecipeError",
    "RECIPE_FIELDS",
    "FLAGS",
    "CHOICES",
    "DEFAULT_K",
    "DEFAULT_WEIGHTING",
    "field_docs",
    "recipe_of",
    "infer_recipe",
    "recipe_command",
]

DEFAULT_K = {"fullhead": 4, "cachebridge": 2}  # source layers per target layer, by method
DEFAULT_WEIGHTING = {"fullhead": "uniform", "cachebridge": "attention"}  # row weights, by method


@dataclass(frozen=True)
class FitConfig:
    """How to fit a bridge (see the module docstring). Every field, once:

    method: "fullhead" (Full-Head Mapping: every source KV head of the top-k source layers feeds
        each target head; the default, better on every measured pair,
        benchmarks/reports/quality.md) or "cachebridge" (the matched source head of each of the
        top-k layers).
    num_sequences: calibration sequences (at least 2: every `heldout_every`-th one is held out
        to score the maps).
    seq_len: target tokens per calibration sequence (at most the models' context window).
    domain: built-in calibration text (bridgecache.text's "calib" split): "prose", "code" or
        "mixed" (the two alternating, then code once the prose runs out).
    text: the user's own calibration text instead (None: the built-in): a text file or folder
        path, a list of strings or of paths, or a Hugging Face datasets Dataset/IterableDataset
        (its `text_column`); read in order and windowed like the built-in text. A bridge records
        it by the sha256 of the documents read ("sha256:..."), never the text.
    text_column: the dataset column that holds the text.
    seed: which windows of the built-in text are read (the user's text is read in order).
    heldout_every: every this-many-th sequence is held out (scores the maps, is not fitted).
    layers_k: source layers per target layer (None: the method's, DEFAULT_K: 4 or 2).
    layer_support: how those layers are chosen: "probe" (held-out R^2 of single-layer probes) or
        "depth" (nearest in relative depth; no probe pass unless heads must be matched).
    weighting: row weights, "uniform" or "attention" (the target's own attention; None: the
        method's, DEFAULT_WEIGHTING).
    lam: ridge strength relative to the data scale (bridgecache.fitting.ridge).
    key_scale: "variance" stretches mapped keys to the target keys' spread (sharper attention);
        "none" keeps the ridge map.
    alignment_policy: which source rows feed a target token across tokenizers, a tokenalign
        policy (None: "last"); recorded in the bridge.
    native_head: target positions [0, native_head) that the target computes itself; never fitted.
    boundaries: prefix boundaries at which the attention weights are measured.
    probe_subset: layer probes read only the first this many sequences (plus a held-out one if
        none is among them), each a forward of both models (None, or "all" on the command line:
        every sequence).
    stats_precision: products of the maps' statistics (bridgecache.fitting.products): "bf16-gemm"
        (the default: GEMMs on the gathered rows rounded to bfloat16, exact products summed in
        float32 per chunk on CUDA and in float64 across chunks), "tf32x3" (the same GEMMs on
        float64 rows; the default before 2026-12-07, and what a recipe without this key was
        fitted at), "tf32" or "bf16" (the fused kernel's products on CUDA without materialising
        the rows: benchmarks/reports/gpu-kernels.md; its PyTorch reference on the CPU forms
        float32 products).
    identity_if_same: the same model (or bit-identical weights and tokenizer) on both sides gives
        the exact identity bridge, without any regression.
    score_heldout: measure each target layer's attention-output cosine on the held-out sequences
        (bridgecache.fitting.heldout; what the quality gate reads). Changes no map, so the recipe
        leaves it out.
    score_sequences: how many held-out sequences the scoring reads, spread evenly over them (None,
        or "all" on the command line: every one). Each is a forward of both models and a
        translation: a 500-sequence fit holds 62. Changes no map, so the recipe leaves it out.
    memory_budget_gb: GiB the fit's own buffers (layer-probe rows, statistics) may take on the
        fitting device (None: on CUDA 90% of what is free when the fit starts, less one batch's
        forwards and KV, 1 GiB plus the batch's KV bytes below; on CPU no limit). Statistics
        beyond it take more passes over the text; probes beyond it are refused before any
        forward. Changes no map, so the recipe leaves it out.
    batch_sequences: calibration sequences per forward pass of each model (None: as many as make
        about 8,192 tokens, their KV within 3 GiB, or on CUDA within a quarter of the free memory
        when that is more; bridgecache.fitting.fit.calibration_batch).
        Changes no map beyond float rounding, so the recipe leaves it out.
    """

    method: str = "fullhead"
    num_sequences: int = 32
    seq_len: int = 256
    domain: str = "prose"
    text: object = None
    text_column: str = "text"
    seed: int = 0
    heldout_every: int = 8
    layers_k: int | None = None
    layer_support: str = "probe"
    weighting: str | None = None
    lam: float = 1e-2
    key_scale: str = "variance"
    alignment_policy: str | None = None
    native_head: int = 1
    boundaries: int = 32
    probe_subset: int | None = 16
    stats_precision: str = "bf16-gemm"
    identity_if_same: bool = True
    score_heldout: bool = True
    score_sequences: int | None = 16
    memory_budget_gb: float | None = None
    batch_sequences: int | None = None

    def __post_init__(self):
        """Raise FitOptionError for the first field outside its range (before any model loads)."""
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if not (value is None and name in _NONE_ALLOWED) and value not in allowed:
                _bad(name, value, f"one of {allowed}")
        # The upper bounds are the bridge file reader's (bridgecache.bridge.format): a config that
        # fits is a config whose bridge loads.
        _int_at_least("num_sequences", self.num_sequences, 2, "one sequence is held out to score the maps")
        _int_at_least("native_head", self.native_head, 0)
        head = self.native_head
        _int_at_least("seq_len", self.seq_len, head + 2, f"native_head={head} positions are not fitted")
        _int_at_least("seed", self.seed, 0, high=MAX_SEED)
        for name in ("heldout_every", "boundaries"):
            _int_at_least(name, getattr(self, name), 1)
        for name in ("layers_k", "probe_subset", "score_sequences", "batch_sequences"):
            if getattr(self, name) is not None:
                high = SPEC_LIMITS["num_layers"] if name == "layers_k" else None
                _int_at_least(name, getattr(self, name), 1, high=high)
        self._check_text()
        budget = self.memory_budget_gb
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget < math.inf
        ):
            _bad("memory_budget_gb", budget, "None or a finite number of GiB > 0")
        lam = self.lam
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam <= 0:
            _bad("lam", lam, "a finite number > 0 (ridge strength relative to the data scale)")
        for name in ("identity_if_same", "score_heldout"):
            if not isinstance(getattr(self, name), bool):
                _bad(name, getattr(self, name), "True or False")

    def _check_text(self) -> None:
        if not isinstance(self.text_column, str) or not self.text_column:
            _bad("text_column", self.text_column, "a column name")
        if self.text is None or isinstance(self.text, UserText) or _is_digest(self.text):
            return
        try:
            object.__setattr__(self, "text", user_text(self.text, self.text_column))
        except (TypeError, ValueError, OSError) as err:  # OSError: a name the lookup refuses (too long)
            _bad(
                "text",
                _shown(self.text),
                f"a file or folder path, strings, or a dataset ({str(err)[:300]})",
            )
        if self.domain != "prose":
            _bad("domain", self.domain, "the default with text= (domain picks built-in text only)")

    @property
    def text_needed(self) -> str | None:
        """The recorded digest when this config names its text by hash only (read from a recipe)."""
        return self.text if _is_digest(self.text) else None

    def check_against(self, source_spec) -> None:
        """The checks that need the source model (its ModelSpec): layers_k at most its layers."""
        if self.layers_k is not None and self.layers_k > source_spec.num_layers:
            _bad("layers_k", self.layers_k, f"at most the source model's {source_spec.num_layers} layers")

    def replace(self, **changes) -> FitConfig:
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)

    def changes(self) -> dict:
        """The fields that differ from FitConfig()'s, by name (in field order)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if _differs(self, f.name)}

    @property
    def label(self) -> str:
        """A short description for tables and logs: only what differs from the defaults."""
        return " ".join(f"{name}={value}" for name, value in self.changes().items()) or "default"

    def recipe(self, source: str, target: str, text_digest: str | None = None) -> dict:
        """What a bridge records of its fit: the model names and every field that changes the maps
        (the user's text as `text_digest`, the "sha256:..." of the documents read)."""
        fields = {name: getattr(self, name) for name in RECIPE_FIELDS}
        if isinstance(self.text, UserText):
            fields["text"] = text_digest
        if fields["text"] is None:  # the built-in text: recipes read as they always have
            del fields["text"]
        return {"source": source, "target": target, **fields}

    @classmethod
    def from_recipe(cls, recipe: dict) -> FitConfig:
        """The FitConfig of a recorded recipe (its model names aside; a missing key: the value
        fits had before the key was recorded, `BEFORE_RECORDED`, else the default)."""
        unknown = sorted(set(recipe) - {"source", "target"} - set(RECIPE_FIELDS))
        if unknown:
            raise RecipeError(
                f"recipe entries {unknown} are not FitConfig fields ({', '.join(RECIPE_FIELDS)})"
            )
        return cls(**{**BEFORE_RECORDED, **{name: v for name, v in recipe.items() if name in RECIPE_FIELDS}})


class FitOptionError(ValueError):
    """A FitConfig field outside its range: `option` (the field), `value` and what is `expected`."""

    def __init__(self, option: str, value, expected: str):
        super().__init__(f"{option} is {value!r}; expected {expected}")
        self.option, self.value, self.expected = option, value, expected


class RecipeError(ValueError):
    """A bridge records no recipe (an identity bridge, or fitted before recipes were recorded)."""


# "bf16-gemm", "tf32x3": GEMMs on gathered rows (bridgecache.fitting.products); the fused kernel's
STATS_PRECISIONS = ("bf16-gemm", *KERNEL_PRECISIONS)
CHOICES = {
    "method": tuple(DEFAULT_K),
    "domain": ("prose", "code", "mixed"),
    "layer_support": ("probe", "depth"),
    "weighting": ("uniform", "attention"),
    "key_scale": ("variance", "none"),
    "alignment_policy": POLICIES,
    "stats_precision": STATS_PRECISIONS,
}
# A recipe without a key was fitted at what fits did then, not at today's default.
BEFORE_RECORDED = {"stats_precision": "tf32x3"}
_NONE_ALLOWED = ("weighting", "alignment_policy")  # None: the method's / tokenalign's default
MAX_SEED = 2**63 - 1  # the bridge file reader's bound
# Every field but those that change no map (the scoring's, memory_budget_gb, batch_sequences) or
# are not kept (text_column: the text is recorded by its digest).
_NOT_RECORDED = ("score_heldout", "score_sequences", "memory_budget_gb", "batch_sequences", "text_column")
RECIPE_FIELDS = tuple(f.name for f in dataclasses.fields(FitConfig) if f.name not in _NOT_RECORDED)
# Field -> `bridgecache fit` flag (its name with dashes, but one).
FLAGS = {f.name: "--" + f.name.replace("_", "-") for f in dataclasses.fields(FitConfig)}
FLAGS["num_sequences"] = "--calib-seqs"


def field_docs() -> dict[str, str]:
    """Each field's entry in FitConfig's docstring, on one line (the command's --help)."""
    docs, name = {}, None
    for line in inspect.cleandoc(FitConfig.__doc__).splitlines():
        entry = re.match(r"(\w+): (.*)", line)
        if entry and entry[1] in FLAGS:
            name = entry[1]
            docs[name] = entry[2]
        elif name and line.startswith(" "):
            docs[name] += " " + line.strip()
        else:
            name = None
    return docs


def recipe_of(bridge) -> dict:
    """The recorded fit recipe of `bridge` (a copy)."""
    recipe = bridge.calibration.get("recipe")
    if not recipe:
        raise RecipeError(
            f"bridge {bridge.source.name} -> {bridge.target.name} ({bridge.method}) records no fit "
            "recipe: it was not made by fit_bridge, or by a bridgecache older than recipes"
        )
    return dict(recipe)


def infer_recipe(bridge) -> dict:
    """The recipe of a bridge fitted before recipes were recorded, rebuilt from its calibration record.

    Every setting that decides the maps is in that record (resolved: `layers_k` and `weighting`
    hold the values the method defaults gave); `probe_subset` and `identity_if_same` were never
    recorded and take FitConfig's defaults.
    """
    calib = bridge.calibration
    needed = ("num_sequences", "seq_len", "domain", "seed", "heldout_every", "layers_k", "layer_support")
    needed += ("lam", "weighting", "key_scale")
    missing = [key for key in needed if key not in calib]
    if missing or bridge.method not in DEFAULT_K:
        raise RecipeError(
            f"bridge {bridge.source.name} -> {bridge.target.name} ({bridge.method}): its calibration "
            f"record lacks {missing or 'a fitted method'}, so its recipe cannot be rebuilt; fit it again"
        )
    return {
        "source": bridge.source.name,
        "target": bridge.target.name,
        "method": bridge.method,
        **{key: calib[key] for key in needed},
        "alignment_policy": None if bridge.alignment_policy == "identity" else bridge.alignment_policy,
        "native_head": bridge.native_head,
        "boundaries": calib.get("boundaries") or FitConfig.boundaries,
        "probe_subset": FitConfig.probe_subset,
        "identity_if_same": FitConfig.identity_if_same,
    }


def recipe_command(recipe: dict, out: str = "DIR") -> str:
    """The `bridgecache fit` command that makes this recipe: every recorded setting, defaults
    included (the command makes the same maps after a default changes); a None that is the
    command's default too is left out."""
    words = ["bridgecache", "fit", "--source", str(recipe["source"]), "--target", str(recipe["target"])]
    for name in RECIPE_FIELDS:
        if name not in recipe or (recipe[name] is None and getattr(FitConfig, name) is None):
            continue
        value, flag = recipe[name], FLAGS[name]
        if name == "text" and value is not None:  # the user's text, named by its digest: give it again
            words += [flag, str(value)]
            continue
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [flag, "all" if value is None else str(value)]  # None: probe_subset's "all"
    return shlex.join([*words, "--out", out])


def _differs(config: FitConfig, name: str) -> bool:
    return getattr(config, name) != getattr(FitConfig, name)


def _int_at_least(name: str, value, low: int, why: str = "", high: int | None = None) -> None:
    high = _MAX_COUNT if high is None else high
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _bad(name, value, f"an integer >= {low}" + (f" ({why})" if why else ""))
    if value > high:
        _bad(name, value, f"an integer of at most {high:,} (what a bridge file may record)")


_MAX_COUNT = 2**31  # counts in a bridge file (bridgecache.bridge.format LIMITS["count"])


def _is_digest(value) -> bool:
    return isinstance(value, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", value) is not None


class _Shown(str):
    """A value's repr, cut to 80 characters (an error never repeats a whole text)."""

    def __repr__(self) -> str:
        return str(self)


def _shown(value) -> _Shown:
    text = repr(value)
    return _Shown(text if len(text) <= 80 else text[:77] + "...")


def _bad(name: str, value, expected: str) -> None:
    raise FitOptionError(name, value, expected)
