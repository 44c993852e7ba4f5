"""The model side of the hf reference server: load, batched generation, weight reload.

Everything here is synchronous torch work; the aiohttp app runs it in a worker thread.

A `Decode` is one batch on its way: prompts are left-padded, the prompt pass fills a KV
cache, then one token per row per step. Each row keeps its own sampling parameters, random
generator and stop conditions; a finished row rides along (fed padding) until the whole batch
is done. `Decode.run` returns early when told to suspend, keeping its cache, so the batcher
can pause a batch in place, retract its rows (they continue later from prompt + output so
far, with a fresh cache), or abort them.

Logprobs: a reported logprob is that of the sampled token under the distribution it was drawn
from before truncation, log_softmax(logits / temperature). For greedy rows (temperature 0,
which SGLang turns into top_k 1 at temperature 1) that is log_softmax(raw logits). top-k /
top-p / min-p truncation narrows the candidates but is not renormalised into the reported
value, which is what a trainer recomputes from the same logits and temperature.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_cli.server.protocol import RequestError, Sampling, finish_abort

# Below this many parameters CPU decoding runs on one intra-op thread (see _auto_cpu_threads).
SMALL_MODEL_PARAMS = 50_000_000

__all__ = ["Decode", "Engine", "GenRequest", "GenResult", "RequestError", "WeightLoadError"]


class WeightLoadError(RuntimeError):
    """New weights could not be loaded; the old ones stay in place."""


@dataclass
class Control:
    """Flags a running `Decode` looks at between steps (set from the event loop)."""

    abort: threading.Event = field(default_factory=threading.Event)
    suspend: threading.Event = field(default_factory=threading.Event)
    abort_rids: set[str] = field(default_factory=set)


@dataclass
class GenRequest:
    input_ids: list[int]
    params: Sampling
    # The batcher sets it on arrival (see Batcher.submit).
    seed: int = 0
    rid: str = ""
    top_logprobs_num: int = 0
    # Progress, kept across retractions: what earlier segments of this request produced.
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    retractions: int = 0
    # [version, start, end) over output positions: which weights sampled which tokens.
    spans: list[list[Any]] = field(default_factory=list)
    finished: dict[str, Any] | None = None
    text: str | None = None
    generator: Any = None

    def record_span(self, version: str, start: int) -> None:
        end = len(self.output_ids)
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = end
        elif end > start or not self.spans:
            self.spans.append([version, start, end])


@dataclass
class GenResult:
    output_ids: list[int]
    logprobs: list[float]
    # Per output position: [(token_id, logprob), ...] best first, when top_logprobs_num > 0.
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: dict[str, Any]
    text: str
    prompt_tokens: int
    retractions: int = 0
    spans: list[list[Any]] = field(default_factory=list)

    @property
    def weight_version(self) -> str:
        return self.spans[-1][0] if self.spans else ""


class Engine:
    """One causal LM and its tokenizer on one device."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        cpu_threads: int | None = None,
        revision: str | None = None,
    ):
        # A local directory or a hub id, which transformers resolves from its cache or the hub.
        self.model_path = str(model_path)
        self.revision = revision
        self.weights_path = self.model_path
        self.requested_device = device
        self.requested_dtype = dtype
        self.cpu_threads = cpu_threads
        self.model: Any = None
        self.tokenizer: Any = None
        self.device = "cpu"
        self.dtype: Any = None
        self.eos_token_ids: set[int] = set()
        self.pad_token_id = 0
        self.vocab_size = 0
        self.context_length = 0
        self._cache_kwarg = "past_key_values"
        self._keep_kwarg: str | None = None

    # -- loading ----------------------------------------------------------------------------

    def load(self) -> None:
        import torch
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        local = Path(self.model_path).expanduser()
        if not local.exists() and self.model_path.startswith(("/", ".", "~")):
            raise FileNotFoundError(f"no such model directory: {local}")
        self.device = _pick_device(self.requested_device)
        self.dtype = _pick_dtype(self.requested_dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, revision=self.revision)
        model = _from_pretrained(self.model_path, self.dtype, revision=self.revision)
        model = model.to(self.device)
        if self.device == "cpu":
            _own_memory(model)
        model.eval()
        self.model = model

        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context_length = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 20)
        self.eos_token_ids = _eos_ids(
            cfg, self.tokenizer, getattr(model, "generation_config", None)
        )
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else min(self.eos_token_ids, default=0))

        # transformers 5 renamed past_key_values to cache, and 4.x had two spellings of
        # "only compute the last position's logits".
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keep_kwarg = next(
            (k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None
        )
        if self.device == "cpu":
            torch.set_num_threads(self.cpu_threads or _auto_cpu_threads(model))
        self._warm_up()

    def _warm_up(self) -> None:
        # The first forward pass pays for lazy initialisation (kernels, mask helpers); pay it
        # before the server reports ready rather than in the first request.
        sp = Sampling(max_new_tokens=2, ignore_eos=True)
        self.generate([GenRequest([self.pad_token_id] * n, sp, seed=0) for n in (1, 2)])

    def read_weights(self, path: str | Path) -> dict[str, Any]:
        """Load a checkpoint's weights on the CPU and check they fit the served model.

        Nothing is swapped yet; `swap_weights` installs the result.
        """
        p = Path(path).expanduser()
        if not p.is_dir():
            raise WeightLoadError(f"{p} is not a directory")
        try:
            new, info = _from_pretrained(str(p), self.dtype, output_loading_info=True)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError, ...
            raise WeightLoadError(f"cannot load weights from {p}: {e}") from e
        # transformers fills tensors a checkpoint lacks with random values and only warns.
        absent = sorted(info.get("missing_keys") or [])
        if absent:
            raise WeightLoadError(f"checkpoint {p} lacks {len(absent)} tensors, e.g. {absent[0]}")
        state = new.state_dict()
        current = self.model.state_dict()
        missing = sorted(set(current) - set(state))
        if missing:
            raise WeightLoadError(
                f"checkpoint {p} lacks {len(missing)} tensors of the served model, e.g. {missing[0]}"
            )
        for name, tensor in current.items():
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise WeightLoadError(
                    f"checkpoint {p} does not fit the served model: {name} has shape "
                    f"{tuple(state[name].shape)}, expected {tuple(tensor.shape)}"
                )
        return {name: state[name] for name in current}

    def swap_weights(self, state: dict[str, Any], path: str | Path | None = None) -> None:
        """Copy weights from `read_weights` into the model (a subset of the tensors is
        fine). Call only between batches."""
        import torch

        params = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)
        if path is not None:
            self.weights_path = str(path)

    def adopt_weights(self, state: dict[str, Any]) -> dict[str, Any]:
        """Make the received tensors the model's own (no copy): each must have the served
        dtype, shape and device. Returns the tensors they replace, which a later update can
        receive into. Call only between batches."""
        holders = self._holders()
        old = {}
        for name, tensor in state.items():
            module, attr = holders[name]
            current = getattr(module, attr)
            old[name] = current.data
            current.data = tensor
        return old

    def _holders(self) -> dict[str, tuple[Any, str]]:
        """state-dict name -> (module, attribute) of every parameter and buffer, tied ones
        under each of their names."""
        out = {}
        for name, _ in self.model.named_parameters(remove_duplicate=False):
            prefix, _, attr = name.rpartition(".")
            out[name] = (self.model.get_submodule(prefix), attr)
        for name, _ in self.model.named_buffers(remove_duplicate=False):
            prefix, _, attr = name.rpartition(".")
            out[name] = (self.model.get_submodule(prefix), attr)
        return out

    def tensor_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name -> (dtype name, shape) of every tensor a weight update may replace."""
        return {
            name: (str(t.dtype).removeprefix("torch."), tuple(t.shape))
            for name, t in self.model.state_dict().items()
        }

    # -- text -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_request(self, req: GenRequest) -> None:
        """Reject what generation cannot do, before the request joins a batch."""
        if not req.input_ids:
            raise RequestError("input_ids cannot be empty.")  # io_struct.py:499
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if len(req.input_ids) >= self.context_length:  # tokenizer_manager.py:1337-1351
            raise RequestError(
                f"The input ({len(req.input_ids)} tokens) is longer than the model's context "
                f"length ({self.context_length} tokens)."
            )

    # -- generation -------------------------------------------------------------------------

    def generate(self, reqs: list[GenRequest]) -> list[GenResult]:
        """Decode `reqs` as one batch to the end (warm-up and tests)."""
        decode = Decode(self, reqs)
        decode.run(Control())
        return [r for r in decode.results() if r is not None]

    def _forward(self, ids: Any, mask: Any, positions: Any, cache: Any) -> tuple[Any, Any]:
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": positions,
            "use_cache": True,
            self._cache_kwarg: cache,
        }
        if self._keep_kwarg:
            kwargs[self._keep_kwarg] = 1
        out = self.model(**kwargs)
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[:, -1, :].float(), new_cache


class Decode:
    """One batch mid-decode: its rows, the KV cache and the logits of the next step.

    Call `run` in the torch thread; it returns True when every row has finished, or False
    when `control.suspend` was set (the state stays, and `run` continues it later; the
    weights may have changed in between, as with SGLang's in-place pause). `retract()`
    hands the unfinished requests back, their progress kept, to be decoded again later.
    """

    def __init__(self, engine: Engine, reqs: list[GenRequest]):
        self.engine = engine
        self.reqs = reqs
        self.rows = [_Row(r, engine) for r in reqs]
        self.answered = [False] * len(reqs)
        self._started = False
        self._feed: Any = None  # tokens sampled last step, not yet run through the model
        self._logits: Any = None
        self._cache: Any = None
        self._mask: Any = None
        self._positions: Any = None

    def run(self, control: Control) -> bool:
        import torch

        with torch.inference_mode():
            return self._run(control)

    def _run(self, control: Control) -> bool:
        import torch

        if all(row.done for row in self.rows):
            return True
        if not self._started:
            self._prefill()
        temps = torch.tensor([r.params.temperature for r in self.reqs], device=self.engine.device)
        top_n = max(r.top_logprobs_num for r in self.reqs)
        while True:
            if self._feed is not None:
                self._step_forward()
            self._abort_marked(control)
            if control.suspend.is_set() or all(row.done for row in self.rows):
                return all(row.done for row in self.rows)
            logprobs = torch.log_softmax(self._logits / temps[:, None], dim=-1)
            tokens = self._sample(self._logits / temps[:, None])
            chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
            tops = logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1) if top_n else None
            token_list = tokens.tolist()
            for i, row in enumerate(self.rows):
                if not row.done:
                    top = None
                    if tops is not None and row.req.top_logprobs_num:
                        k = row.req.top_logprobs_num
                        idx, val = tops.indices[i, :k].tolist(), tops.values[i, :k].tolist()
                        top = list(zip(idx, val, strict=True))
                    row.push(token_list[i], chosen[i], top, self.engine)
            if all(row.done for row in self.rows):
                return True
            pad = self.engine.pad_token_id
            self._feed = [
                t if not row.done else pad for t, row in zip(token_list, self.rows, strict=True)
            ]

    def _prefill(self) -> None:
        import torch

        dev = self.engine.device
        prompts = [r.input_ids + r.output_ids for r in self.reqs]
        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((n, width), self.engine.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        ids, self._mask = ids.to(dev), mask.to(dev)
        self._positions = (self._mask.cumsum(-1) - 1).clamp(min=0)
        self._logits, self._cache = self.engine._forward(ids, self._mask, self._positions, None)
        self._started = True

    def _step_forward(self) -> None:
        import torch

        dev = self.engine.device
        feed = torch.tensor(self._feed, device=dev)[:, None]
        n = feed.shape[0]
        self._mask = torch.cat(
            [self._mask, torch.ones((n, 1), dtype=self._mask.dtype, device=dev)], dim=1
        )
        self._positions = self._positions[:, -1:] + 1
        self._logits, self._cache = self.engine._forward(
            feed, self._mask, self._positions, self._cache
        )
        self._feed = None

    def _abort_marked(self, control: Control) -> None:
        for row in self.rows:
            if not row.done and (control.abort.is_set() or row.req.rid in control.abort_rids):
                row.req.finished = finish_abort()

    def _sample(self, scaled: Any) -> Any:
        import torch

        reqs = self.reqs
        vocab = scaled.shape[-1]
        filtered = scaled
        top_k = [r.params.top_k for r in reqs]
        top_p = [r.params.top_p for r in reqs]
        min_p = [r.params.min_p for r in reqs]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p) or any(min_p):
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            ks = torch.tensor([min(k, vocab) for k in top_k], device=scaled.device)
            ranks = torch.arange(vocab, device=scaled.device)[None, :]
            drop = ranks >= ks[:, None]
            probs = sorted_logits.softmax(dim=-1)
            # A row without top-p gets a bound its cumulative mass never reaches, even rounded.
            ps = torch.tensor(
                [p if p < 1.0 else 2.0 for p in top_p], device=scaled.device, dtype=probs.dtype
            )
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop |= (probs.cumsum(dim=-1) - probs) >= ps[:, None]
            mins = torch.tensor(min_p, device=scaled.device, dtype=probs.dtype)
            drop |= probs < mins[:, None] * probs[:, :1]
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            filtered = torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)
        probs = filtered.softmax(dim=-1)
        argmax = scaled.argmax(dim=-1)
        picks = []
        for i, row in enumerate(self.rows):
            if row.req.params.greedy or row.done:
                picks.append(argmax[i])
            else:
                picks.append(torch.multinomial(probs[i], 1, generator=row.req.generator)[0])
        return torch.stack(picks)

    def finished_indices(self) -> list[int]:
        """Rows finished and not yet handed out (see `take`)."""
        return [i for i, row in enumerate(self.rows) if row.done and not self.answered[i]]

    def take(self, i: int) -> GenResult:
        self.answered[i] = True
        return self.rows[i].result(self.engine)

    def results(self) -> list[GenResult | None]:
        return [self.take(i) if self.rows[i].done else None for i in range(len(self.rows))]

    def retract(self) -> list[GenRequest]:
        """The unfinished requests, to run again from prompt + output so far."""
        out = []
        for row in self.rows:
            if not row.done:
                row.req.retractions += 1
                out.append(row.req)
        self._cache = self._logits = None
        return out


class _Row:
    """One request's progress through a batch (its state lives on the request itself)."""

    def __init__(self, req: GenRequest, engine: Engine):
        import torch

        self.req = req
        p = req.params
        done_tokens = len(req.output_ids)
        room = engine.context_length - len(req.input_ids)
        limit = room if p.max_new_tokens is None else min(p.max_new_tokens, room)
        self.budget = max(0, limit)
        self.stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            self.stop_ids |= engine.eos_token_ids
        if req.generator is None:
            req.generator = torch.Generator(device=engine.device).manual_seed(req.seed % (1 << 63))
        if req.finished is None and done_tokens >= self.budget:
            req.finished = {"type": "length", "length": done_tokens}

    @property
    def done(self) -> bool:
        return self.req.finished is not None

    def push(
        self, token: int, logprob: float, top: list[tuple[int, float]] | None, engine: Engine
    ) -> None:
        req = self.req
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        if top is not None:
            req.top_logprobs.append(top)
        if token in self.stop_ids:
            req.finished = {"type": "stop", "matched": token}
            return
        if req.params.stop:
            text = engine.decode(req.output_ids, req.params.skip_special_tokens)
            for s in req.params.stop:
                at = text.find(s)
                if at >= 0:
                    req.text = text if req.params.no_stop_trim else text[:at]
                    req.finished = {"type": "stop", "matched": s}
                    return
        if len(req.output_ids) >= self.budget:
            req.finished = {"type": "length", "length": len(req.output_ids)}

    def result(self, engine: Engine) -> GenResult:
        req = self.req
        text = req.text
        if text is None:
            text = engine.decode(req.output_ids, req.params.skip_special_tokens)
        return GenResult(
            output_ids=req.output_ids,
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs,
            finish_reason=req.finished or finish_abort(),
            text=text,
            prompt_tokens=len(req.input_ids),
            retractions=req.retractions,
            spans=req.spans,
        )


def _pick_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
    return requested


def _auto_cpu_threads(model: Any) -> int:
    """Intra-op threads for CPU decoding. A small model's step is a few microseconds of math
    per op, and a second thread only adds hand-off (measured: 10x slower on a busy 2-core
    machine); bigger models get torch's default."""
    import torch

    params = sum(p.numel() for p in model.parameters())
    return 1 if params < SMALL_MODEL_PARAMS else torch.get_num_threads()


def _pick_dtype(requested: str, device: str) -> Any:
    import torch

    if requested == "auto":
        if device.startswith("cuda") and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        requested
    ]


def _own_memory(model: Any) -> None:
    """Copy the weights out of the checkpoint's memory map: an update that writes into a
    mapped page pays a copy-on-write fault for it (measured: a first weight sync twice as
    slow as the next)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()


def _from_pretrained(path: str, dtype: Any, **kwargs: Any) -> Any:
    import transformers
    from transformers import AutoModelForCausalLM

    # transformers 5 spells it dtype; 4.x torch_dtype.
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(path, **{key: dtype}, **kwargs)


def _eos_ids(config: Any, tokenizer: Any, gen_config: Any) -> set[int]:
    ids: set[int] = set()
    for source in (gen_config, config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
