"""Canary sets: prompts with known answers, one YAML file per model (`canaries/`).

A set is validated like the inventory (frozen msgspec structs, one-line
`file:line: key: message` errors, exit 2). Every prompt runs at temperature 0
and carries its golden `expected_token_ids` (or `expected_text` for servers that
return no ids), optionally the range its first top logprob must stay in, and a
timeout. `dump_canary_set` writes the YAML that `ftctl canary record` ships.

This module does no I/O beyond reading and writing set files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from msgspec import Meta

from dynamo_ftctl.errors import InventoryError
from dynamo_ftctl.structs import StrictStruct, load_struct, to_data

__all__ = ["CanaryPrompt", "CanarySet", "dump_canary_set", "ensure_loaded", "load_canary_set"]


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

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.expected_token_ids is None and self.expected_text is None:
            msg = "give expected_token_ids or expected_text"
            raise ValueError(msg)
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
    prompts: Annotated[tuple[CanaryPrompt, ...], Meta(min_length=1)]

    def __post_init__(self) -> None:
        super().__post_init__()
        seen: set[str] = set()
        for prompt in self.prompts:
            if prompt.name in seen:
                msg = f"duplicate prompt name {prompt.name!r}"
                raise ValueError(msg)
            seen.add(prompt.name)

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
    )
    class _Dumper(yaml.SafeDumper):
        pass

    def _list(dumper: yaml.SafeDumper, data: list[object]) -> yaml.Node:
        # Token ids and ranges on one line each: a set stays readable in review.
        flow = all(isinstance(v, int | float) for v in data)
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
