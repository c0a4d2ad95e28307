"""Canary sets: prompts with known answers, one YAML file per model (`canaries/`).

A set is validated like the inventory (frozen msgspec structs, one-line
`file:line: key: message` errors, exit 2). Every prompt runs at temperature 0.
A set says its `kind`:

- `exact` (the default): every prompt carries its golden `expected_token_ids`
  (or `expected_text` for servers that return no ids), optionally the range its
  first top logprob must stay in, and a timeout. It catches wrong answers.
- `shape`: for workers whose greedy answers do not repeat (Dynamo's mocker, a
  server reusing cached prefixes). Every prompt carries the shape of a good
  answer instead: the finish reasons seen, a `token_count` range, and latency
  baselines (`ttft_s`, `total_s`) that an answer may exceed by the set's
  `latency_tolerance` factor. It catches a dead or broken worker, not a wrong
  answer (`SHAPE_NOTE`, which every report of a shape set carries).

`dump_canary_set` writes the YAML that `ftctl canary record` ships.

This module does no I/O beyond reading and writing set files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from msgspec import Meta

from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.structs import KeyedValueError, StrictStruct, load_struct, to_data

__all__ = [
    "DEFAULT_LATENCY_TOLERANCE",
    "EXACT_NOTE",
    "SHAPE_NOTE",
    "CanaryPrompt",
    "CanarySet",
    "SetKind",
    "dump_canary_set",
    "ensure_loaded",
    "load_canary_set",
]

SetKind = Literal["exact", "shape"]
# What each kind of set can tell (every probe report carries its set's line).
EXACT_NOTE = "exact: compares every answer with its golden tokens"
SHAPE_NOTE = "shape: detects a dead or broken worker, not wrong answers"
# A shape set's answer may take this many times its recorded latency (`latency_tolerance`).
DEFAULT_LATENCY_TOLERANCE = 4.0
_EXACT_FIELDS = ("expected_token_ids", "expected_text", "expected_top_logprob_range")
_SHAPE_FIELDS = ("finish_reasons", "token_count", "ttft_s", "total_s")


class CanaryPrompt(StrictStruct, frozen=True):
    """One canary request and its golden answer."""

    name: Annotated[str, Meta(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9._-]+$")]
    prompt: Annotated[
        str, Meta(min_length=1, description="Completion prompt (or the user message)."),
    ]
    max_tokens: Annotated[int, Meta(ge=1, le=4096, description="Tokens to generate.")] = 8
    expected_token_ids: Annotated[
        tuple[Annotated[int, Meta(ge=0)], ...] | None,
        Meta(description="Golden generated token ids (servers that return them)."),
    ] = None
    expected_text: Annotated[
        str | None, Meta(description="Golden generated text (for servers that return no ids)."),
    ] = None
    expected_top_logprob_range: Annotated[
        tuple[float, float] | None,
        Meta(description="[low, high] of the top logprob at the first generated position."),
    ] = None
    timeout_s: Annotated[
        float,
        Meta(gt=0, description="Per-prompt timeout (default: the inventory's canary.timeout_s)."),
    ] | None = None
    finish_reasons: Annotated[
        tuple[Annotated[str, Meta(min_length=1, max_length=63)], ...],
        Meta(min_length=1, description="Shape sets: the finish reasons a good answer has."),
    ] | None = None
    token_count: Annotated[
        tuple[Annotated[int, Meta(ge=1)], Annotated[int, Meta(ge=1)]] | None,
        Meta(description="Shape sets: [low, high] generated tokens of a good answer."),
    ] = None
    ttft_s: Annotated[
        float,
        Meta(gt=0, le=3600, description="Shape sets: time to first token baseline, seconds."),
    ] | None = None
    total_s: Annotated[
        float,
        Meta(gt=0, le=3600, description="Shape sets: whole-answer latency baseline, seconds."),
    ] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.token_count is not None:
            low, high = self.token_count
            if not low <= high <= self.max_tokens:
                msg = (f"token_count must be [low, high] with 1 <= low <= high <= max_tokens "
                       f"({self.max_tokens}), got {list(self.token_count)}")
                raise KeyedValueError(("token_count",), msg)
        if self.ttft_s is not None and self.total_s is not None and self.ttft_s > self.total_s:
            msg = f"ttft_s ({self.ttft_s:g}) is more than total_s ({self.total_s:g})"
            raise KeyedValueError(("ttft_s",), msg)
        if self.expected_token_ids is not None and len(self.expected_token_ids) > self.max_tokens:
            msg = (f"expected_token_ids has {len(self.expected_token_ids)} ids but "
                   f"max_tokens is {self.max_tokens}")
            raise ValueError(msg)
        low_high = self.expected_top_logprob_range
        if low_high is not None and not low_high[0] <= low_high[1] <= 0.0:
            msg = ("expected_top_logprob_range must be [low, high] with low <= high <= 0, "
                   f"got {list(low_high)}")
            raise ValueError(msg)


class CanarySet(StrictStruct, frozen=True, kw_only=True):
    """The canary prompts of one model."""

    kind: Annotated[
        SetKind,
        Meta(description="exact: golden answers; shape: the shape of a good answer "
                         "(nondeterministic workers)."),
    ] = "exact"
    model: Annotated[str, Meta(min_length=1, description="Model id sent in every request.")]
    endpoint: Annotated[
        Literal["completions", "chat"],
        Meta(description="/v1/completions or /v1/chat/completions."),
    ] = "completions"
    temperature: Annotated[
        float, Meta(ge=0.0, le=0.0, description="Always 0: greedy decoding."),
    ] = 0.0
    return_token_ids: Annotated[
        bool,
        Meta(description="Ask for token ids (vLLM's return_token_ids); off for strict servers."),
    ] = True
    recorded_from: Annotated[
        str | None, Meta(description="Where the answers were recorded."),
    ] = None
    recorded_at: Annotated[str | None, Meta(description="When (ISO 8601, UTC).")] = None
    latency_tolerance: Annotated[
        float,
        Meta(ge=1.0, le=1000.0, description="Shape sets: an answer fails past its ttft_s or "
             "total_s times this (default 4)."),
    ] | None = None
    samples: Annotated[
        int, Meta(ge=1, description="Shape sets: answers per prompt measured."),
    ] | None = None
    prompts: Annotated[tuple[CanaryPrompt, ...], Meta(min_length=1)]

    def __post_init__(self) -> None:
        super().__post_init__()
        seen: set[str] = set()
        for prompt in self.prompts:
            if prompt.name in seen:
                msg = f"duplicate prompt name {prompt.name!r}"
                raise ValueError(msg)
            seen.add(prompt.name)
        if self.kind == "shape":
            self._check_shape()
        else:
            self._check_exact()

    def _check_exact(self) -> None:
        for key in ("latency_tolerance", "samples"):
            if getattr(self, key) is not None:
                raise KeyedValueError((key,), f"only a shape set has {key} (kind: shape)")
        for index, prompt in enumerate(self.prompts):
            extra = next((f for f in _SHAPE_FIELDS if getattr(prompt, f) is not None), None)
            if extra is not None:
                msg = f"{extra} belongs to a shape set: add kind: shape, or remove it"
                raise KeyedValueError(("prompts", index, extra), msg)
            if prompt.expected_token_ids is None and prompt.expected_text is None:
                msg = "give expected_token_ids or expected_text"
                raise KeyedValueError(("prompts", index), msg)

    def _check_shape(self) -> None:
        for index, prompt in enumerate(self.prompts):
            extra = next((f for f in _EXACT_FIELDS if getattr(prompt, f) is not None), None)
            if extra is not None:
                msg = (f"a shape set judges no answer's content: remove {extra}, or record "
                       "an exact set")
                raise KeyedValueError(("prompts", index, extra), msg)
            missing = [f for f in _SHAPE_FIELDS if getattr(prompt, f) is None]
            if missing:
                msg = (f"a shape set's prompt needs {', '.join(_SHAPE_FIELDS)}; "
                       f"missing: {', '.join(missing)}")
                raise KeyedValueError(("prompts", index), msg)

    @property
    def note(self) -> str:
        """What this kind of set can tell (`EXACT_NOTE` or `SHAPE_NOTE`)."""
        return SHAPE_NOTE if self.kind == "shape" else EXACT_NOTE

    @property
    def tolerance(self) -> float:
        """A shape set's latency tolerance factor (its own, else the default)."""
        return self.latency_tolerance or DEFAULT_LATENCY_TOLERANCE

    @property
    def wants_logprobs(self) -> bool:
        """True when any prompt checks its top logprob."""
        return any(p.expected_top_logprob_range is not None for p in self.prompts)


def load_canary_set(path: Path | str) -> CanarySet:
    """Read and validate a canary set; errors are `file:line: key: message` (exit 2)."""
    return load_struct(path, CanarySet, what="a canary set mapping with 'model' and 'prompts'")


def dump_canary_set(canary_set: CanarySet, path: Path) -> None:
    """Write a set as YAML, atomically (a rename: never half-written)."""
    import yaml

    from dynamo_ftctl.output import write_atomic

    doc = to_data(canary_set, exclude_none=True)
    header = (
        "# Canary set: golden answers at temperature 0 (`ftctl canary record`).\n"
        "# Token ids are the worker's; logprob ranges may be widened by hand.\n"
    ) if canary_set.kind == "exact" else (
        "# Canary set of kind shape (`ftctl canary record --shape`): the worker's greedy\n"
        f"# answers do not repeat, so probes judge only their shape ({SHAPE_NOTE}).\n"
        "# Ranges and latencies may be widened by hand.\n"
    )
    class _Dumper(yaml.SafeDumper):
        pass

    def _list(dumper: yaml.SafeDumper, data: list[object]) -> yaml.Node:
        # Token ids and ranges on one line each: a set stays readable in review.
        flow = all(isinstance(v, int | float | str) for v in data)
        return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)

    _Dumper.add_representer(list, _list)
    text = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, allow_unicode=False, width=100)
    write_atomic(path, header + text)


def ensure_loaded(path: Path | str) -> CanarySet:
    """`load_canary_set` with a hint when the file is missing (for the CLI)."""
    try:
        return load_canary_set(path)
    except InventoryError as exc:
        if exc.reason == "no such file":
            msg = "no such file; record one with `ftctl canary record --worker NAME --out FILE`"
            raise InventoryError(msg, path=exc.path) from None
        raise
