"""Greedy decoding on a static KV cache, each decode step one CUDA graph on GPUs (engine
``static_cache``).

``model.generate`` decodes a small model launch by launch: every step is hundreds of small
kernels, each waiting on the host, so a GPU decoding 64 rows of a 135M model sits mostly idle.
Here a left-padded batch is prefilled into a ``StaticCache`` sized for its prompts plus the new
tokens; every later step reads and writes only fixed buffers (the last token, its position, a
boolean mask over the cache's columns, the cache itself), so on CUDA it is captured once as a
CUDA graph and replayed: one launch per step. The step itself writes its token into a history
buffer, and the host reads that buffer every ``CHECK_EVERY`` steps to see which rows have
ended. On CUDA it reads one chunk behind: chunk i's tokens go to pinned memory while chunk i + 1
is queued, so the stop-string checks (hundreds of decodes per chunk at batch 64) overlap the
device's work instead of idling it; a chunk decoded after every row ended is dropped.

The computation is the static engine's (transformers' greedy ``generate``) with the mask over
the whole cache instead of the keys so far; masked keys weigh exactly 0. In float32 the two give
the same tokens (tested on the CPU, where the same loop runs without graphs); in bfloat16 a
near-tie of two logits can break differently between any two engines, this one included.
Rows end at EOS or at a stop string, checked token by token as the static engine's stopping
criterion does, and are then padded.

Sliding-window layers (Gemma-3, Qwen2 with ``use_sliding_window``, Mistral-style configs) keep
every column here, as full layers do, and read them through a mask of their own: key column k
is readable from query column q iff it is readable at all and q - k < window, transformers' own
sliding-window rule (a row's columns and positions differ by its padding alone). transformers'
sliding cache is a ring buffer whose writes branch on Python ints that a CUDA graph would
freeze; a full column per token costs the (short) rest of the generation in memory instead.
Eager attention (Gemma-2's: it soft-caps its scores and has no sdpa) reads the same masks in
additive form (0 or the dtype's minimum), refreshed in place. Models that this loop cannot serve
as built (another attention than sdpa or eager, layer kinds other
than full and sliding attention, forward hooks such as ARM's that may read values on the host)
go to the static engine (``unsupported``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from attnlab.models import first_hooked_module, left_pad

log = logging.getLogger(__name__)

CHECK_EVERY = 8  # decode steps between two reads of the tokens by the host
# What each attention implementation reads as a mask: sdpa a boolean one (True: readable), eager an
# additive one (0 readable, the dtype's minimum not: Gemma-2, which has no sdpa, soft-caps there)
MASK_KINDS = {"sdpa": "boolean", "eager": "additive"}
_WINDOW_OF_KIND = {"full_attention": False, "sliding_attention": True}  # layer kind: whether it slides


def _window_size(text) -> int | None:
    return getattr(text, "sliding_window", None)


def unsupported(model) -> str | None:
    """Why the static-cache loop cannot serve ``model`` as it is, or None."""
    implementation = model.config._attn_implementation
    if implementation not in MASK_KINDS:
        return f"attention implementation '{implementation}' (the loop's masks serve sdpa and eager)"
    text = model.config.get_text_config()
    other = sorted(set(getattr(text, "layer_types", None) or []) - set(_WINDOW_OF_KIND))
    if other:
        return f"layer kinds {other} (the loop serves full and sliding-window attention)"
    if getattr(text, "layer_types", None) is None and _window_size(text) is not None \
            and getattr(text, "use_sliding_window", None) is False:
        return ("sliding_window set, use_sliding_window false and no layer_types (which layers slide "
                "is not stated)")
    hooked = first_hooked_module(model)
    if hooked is not None:
        return f"forward hooks on {hooked or 'the model'} (an intervention such as ARM)"
    return None


def mask_windows(text) -> dict[str | None, int | None]:
    """The masks a forward takes, each with its window (None: no window). Keyed by layer kind
    where some layers slide and the config lists the kinds (the model then reads a dict of
    masks, one per kind); key None where one mask serves every layer: all full, or, without
    ``layer_types``, all sliding when ``sliding_window`` is set (as transformers' caches read
    such configs)."""
    kinds = getattr(text, "layer_types", None)
    if kinds is None:
        return {None: _window_size(text)}
    if not any(_WINDOW_OF_KIND[kind] for kind in kinds):
        return {None: None}
    return {kind: _window_size(text) if _WINDOW_OF_KIND[kind] else None for kind in sorted(set(kinds))}


def _windowed(readable: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, window: int | None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``readable`` [B, 1, Q, L] restricted to key columns within ``window`` of each query column
    (``queries`` [Q, 1], ``keys`` [L]): k > q - window. Written into ``out`` where given."""
    if window is None:
        return readable
    return torch.logical_and(readable, keys > queries - window, out=out)


def _attention_mask(windows: dict[str | None, int | None], masks: dict[int | None, torch.Tensor]):
    """What the forward's ``attention_mask`` takes: one mask, or a dict of them by layer kind."""
    if None in windows:
        return masks[windows[None]]
    return {kind: masks[window] for kind, window in windows.items()}


def _additive(readable: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """A boolean mask as eager attention adds it: 0 where readable, the dtype's minimum elsewhere
    (written into ``out`` in place where given: a CUDA graph replays the same buffer)."""
    out = torch.empty(readable.shape, dtype=dtype, device=readable.device) if out is None else out
    return out.fill_(torch.finfo(dtype).min).masked_fill_(readable, 0.0)


def _full_layer_cache(model, width: int):
    """A static cache whose every layer keeps all ``width`` columns (sliding layers included)."""
    from transformers.cache_utils import Cache, StaticLayer

    layers = model.config.get_text_config().num_hidden_layers
    return Cache(layers=[StaticLayer(max_cache_len=width) for _ in range(layers)])


@dataclass
class _State:
    """The fixed buffers a decode step reads and writes (the same addresses at every replay)."""

    token: torch.Tensor  # [B, 1] the last token
    position: torch.Tensor  # [B, 1] its position (real tokens only)
    column: torch.Tensor  # [1] its cache column
    mask: torch.Tensor  # [B, 1, 1, L] bool: the cache columns a query may read
    windows: dict[str | None, int | None]  # the masks the forward takes (mask_windows)
    masks: dict[int | None, torch.Tensor]  # per window: ``mask`` within it (None: ``mask`` itself)
    key_columns: torch.Tensor  # [L] 0, 1, ..., L - 1
    history: torch.Tensor  # [B, max_new_tokens] the tokens decoded so far
    step: torch.Tensor  # [1] the history column the next token goes to
    # eager attention only: per window, ``masks``' additive form (None: the masks go as they are)
    additive: dict[int | None, torch.Tensor] | None = None

    def forward_masks(self):
        """What the forward's ``attention_mask`` takes, refreshed in place for eager attention."""
        if self.additive is None:
            return _attention_mask(self.windows, self.masks)
        for window, out in self.additive.items():
            _additive(self.masks[window], out.dtype, out=out)
        return _attention_mask(self.windows, self.additive)


def _prefill(model, rows: list[list[int]], pad_id: int, width: int, cache) -> _State:
    """Run the prompts into the cache; the state holds the first new token."""
    device = model.device
    ids, real, positions = left_pad(rows, pad_id)
    batch, prompt = ids.shape
    key_real = torch.zeros(batch, width, dtype=torch.bool, device=device)
    key_real[:, :prompt] = real.bool().to(device)
    causal = torch.ones(prompt, width, dtype=torch.bool, device=device).tril()
    mask = causal[None, None] & key_real[:, None, None, :]
    # A padding row reads only itself: no row without a key (sdpa would give NaN, and a NaN
    # value in the cache poisons every query, masked or not, through 0 · NaN).
    padding_rows = ~real.bool().to(device)
    mask[:, 0, :, :prompt] |= torch.diag_embed(padding_rows)
    windows = mask_windows(model.config.get_text_config())
    key_columns = torch.arange(width, device=device)
    queries = torch.arange(prompt, device=device)[:, None]
    prefill_masks = {window: _windowed(mask, queries, key_columns, window) for window in windows.values()}
    eager = MASK_KINDS[model.config._attn_implementation] == "additive"
    if eager:
        prefill_masks = {window: _additive(m, model.dtype) for window, m in prefill_masks.items()}
    logits = model(input_ids=ids.to(device), attention_mask=_attention_mask(windows, prefill_masks),
                   position_ids=positions.to(device), past_key_values=cache, use_cache=True,
                   logits_to_keep=1).logits
    history = torch.zeros(batch, width - prompt, dtype=torch.long, device=device)
    history[:, 0] = logits[:, -1].argmax(-1)
    readable = key_real[:, None, None, :].clone()
    masks = {window: readable if window is None else torch.empty_like(readable) for window in windows.values()}
    additive = {window: torch.empty(readable.shape, dtype=model.dtype, device=device) for window in masks} \
        if eager else None
    return _State(token=history[:, :1].clone(), position=positions[:, -1:].to(device) + 1,
                  column=torch.tensor([prompt], device=device), mask=readable, windows=windows, masks=masks,
                  key_columns=key_columns, history=history, step=torch.tensor([1], device=device),
                  additive=additive)


def _decode_step(model, state: _State, cache) -> None:
    """One greedy step on the fixed buffers (what a CUDA graph captures)."""
    state.mask.index_fill_(-1, state.column, True)  # the last token's column becomes readable
    for window, out in state.masks.items():
        if window is not None:  # in place: a CUDA graph replays the same buffers
            _windowed(state.mask, state.column[:, None], state.key_columns, window, out=out)
    logits = model(input_ids=state.token, attention_mask=state.forward_masks(),
                   position_ids=state.position, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    state.token.copy_(logits[:, -1].argmax(-1, keepdim=True))
    state.history.index_copy_(1, state.step, state.token)
    state.position.add_(1)
    state.column.add_(1)
    state.step.add_(1)


class _Graphed:
    """The decode step as a CUDA graph: two steps run on a side stream first (they are real steps:
    cuBLAS and the allocator settle), then one is captured and replayed for every later step. A
    capture that fails (an operation that reads a value on the host) leaves the loop to run the
    steps one by one, with a warning: slower, the same tokens."""

    def __init__(self, run):
        self.run, self.graph, self.warm, self.failed = run, None, 0, False

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        elif self.failed:
            self.run()
        elif self.warm < 2:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.run()
            torch.cuda.current_stream().wait_stream(stream)
            self.warm += 1
        else:
            self._capture()

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.run()
        except Exception as error:  # noqa: BLE001 -- any capture failure: decode without the graph
            log.warning("CUDA graph capture of the decode step failed (%s: %s): decoding step by step",
                        type(error).__name__, error)
            self.failed = True
            self.run()
            return
        self.graph = graph
        graph.replay()  # capturing records the step without running it


class RowEnds:
    """Where each row ended (the index of its EOS or of the token completing a stop string),
    found incrementally: each check looks only at the tokens decoded since the last one. Both
    static engines count a row's tokens with it, so a stop-string row is the same length whether
    or not its batch decoded on after it (where the pad token is EOS, a pad after a stop string
    would otherwise read as one more generated EOS)."""

    def __init__(self, rows: int, eos_ids: set[int], stopped):
        self.eos_ids, self.stopped = eos_ids, stopped
        self.ends: list[int | None] = [None] * rows
        self.seen = 0

    def update(self, tokens: list[list[int]]) -> bool:
        """Look at the new tokens; whether every row has ended."""
        for r, row in enumerate(tokens):
            if self.ends[r] is None:
                self.ends[r] = next((t for t in range(self.seen, len(row)) if self._ends_at(row, t)), None)
        self.seen = len(tokens[0])
        return all(end is not None for end in self.ends)

    def _ends_at(self, row: list[int], t: int) -> bool:
        return row[t] in self.eos_ids or bool(self.stopped and self.stopped(row[:t + 1]))

    def lengths(self, width: int) -> list[int]:
        """Tokens each row generated: up to its end included, else all ``width``."""
        return [width if end is None else end + 1 for end in self.ends]


class _HostReads:
    """The decoded tokens copied to the host behind the queued work: on CUDA each copy goes to
    pinned memory without blocking, with an event to wait on, so the host reads chunk i while the
    device decodes chunk i + 1 (two buffers, one per copy in flight). On a CPU the copy is done
    when it returns."""

    def __init__(self, history: torch.Tensor):
        self.history, self.cuda = history, history.is_cuda
        self.buffers = [torch.empty(history.shape, dtype=history.dtype, pin_memory=self.cuda) for _ in range(2)]
        self.started = 0

    def start(self, steps: int) -> tuple[int, torch.Tensor, object]:
        buffer = self.buffers[self.started % 2]
        self.started += 1
        buffer[:, :steps].copy_(self.history[:, :steps], non_blocking=self.cuda)
        event = torch.cuda.Event() if self.cuda else None
        if event is not None:
            event.record()
        return steps, buffer, event

    @staticmethod
    def wait(pending) -> tuple[int, list[list[int]]]:
        steps, buffer, event = pending
        if event is not None:
            event.synchronize()
        return steps, buffer[:, :steps].tolist()


def decode_batch(model, rows: list[list[int]], max_new_tokens: int, eos_ids: set[int], pad_id: int,
                 stopped=None, graphs: bool | None = None,
                 overlap: bool | None = None) -> tuple[torch.Tensor, list[int], bool]:
    """([B, steps] new tokens, padded after each row's end; each row's generated count; whether a
    CUDA graph ran the steps). ``stopped(tokens)``: whether a row's tokens hold a stop string.
    ``overlap`` (default: on CUDA) checks each chunk's rows while the next chunk decodes; when a
    check finds every row ended, the chunk decoded meanwhile is dropped, so the tokens and their
    count are those of checking right after each chunk."""
    graphs = model.device.type == "cuda" if graphs is None else graphs
    overlap = model.device.type == "cuda" if overlap is None else overlap
    width = max(len(row) for row in rows) + max_new_tokens
    ends = RowEnds(len(rows), eos_ids, stopped)
    with torch.inference_mode():
        cache = _full_layer_cache(model, width)
        state = _prefill(model, rows, pad_id, width, cache)
        run = _Graphed(lambda: _decode_step(model, state, cache)) if graphs else None
        step = run if run is not None else (lambda: _decode_step(model, state, cache))
        steps = _decode_chunks(step, state, ends, max_new_tokens, lag=1 if overlap else 0)
        tokens = state.history[:, :steps].tolist()
    for row, end in zip(tokens, ends.ends):
        if end is not None:
            row[end + 1:] = [pad_id] * (len(row) - end - 1)
    return (torch.tensor(tokens, dtype=torch.long), ends.lengths(steps),
            run is not None and run.graph is not None)


def _decode_chunks(step, state: _State, ends: RowEnds, max_new_tokens: int, lag: int) -> int:
    """Decode in chunks of CHECK_EVERY steps until every row has ended or ``max_new_tokens``;
    the host reads a chunk's tokens ``lag`` chunks later (0: at once). The steps decoded, as of
    the check that ended the loop."""
    reads = _HostReads(state.history)
    steps, in_flight = 1, []
    finished = ends.update(reads.wait(reads.start(1))[1])
    while not finished:
        queued = min(CHECK_EVERY, max_new_tokens - steps)
        for _ in range(queued):
            step()
        steps += queued
        if queued:
            in_flight.append(reads.start(steps))
        if in_flight and (len(in_flight) > lag or not queued):
            seen, tokens = reads.wait(in_flight.pop(0))
            finished = ends.update(tokens)
            if finished:
                return seen  # the chunk decoded meanwhile is dropped
        if not queued and not in_flight:
            return steps
    return steps
