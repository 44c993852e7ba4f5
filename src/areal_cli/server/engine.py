"""The model side of the hf reference server: load, batched generation, weight reload.

Everything here is synchronous torch work; the aiohttp app runs it in a worker thread.

Generation decodes a batch together: prompts are left-padded, the prompt pass fills a KV
cache, then one token per row per step. Each row keeps its own sampling parameters, its own
random generator and its own stop conditions; a finished row rides along (fed padding) until
the whole batch is done.

Logprobs: a reported logprob is that of the sampled token under the distribution it was drawn
from before truncation, log_softmax(logits / temperature). For greedy rows (temperature 0)
that is log_softmax(raw logits). top-k / top-p truncation narrows the candidates but is not
renormalised into the reported value, which is what a trainer recomputes from the same logits
and temperature.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Below this a temperature means greedy, as SGLang treats it.
GREEDY_TEMPERATURE = 1e-5
# Below this many parameters CPU decoding runs on one intra-op thread (see _auto_cpu_threads).
SMALL_MODEL_PARAMS = 50_000_000


class RequestError(ValueError):
    """A request the engine cannot serve as asked (the HTTP layer answers 400)."""


class WeightLoadError(RuntimeError):
    """New weights could not be loaded; the old ones stay in place."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Parse SGLang-style sampling params; unknown keys are ignored as SGLang does."""
        d = d or {}
        if not isinstance(d, dict):
            raise RequestError("sampling_params must be an object")
        try:
            p = cls(
                max_new_tokens=int(_default(d.get("max_new_tokens"), 128)),
                temperature=float(_default(d.get("temperature"), 1.0)),
                top_p=float(_default(d.get("top_p"), 1.0)),
                top_k=int(_default(d.get("top_k"), -1)),
                stop_token_ids=[int(t) for t in d.get("stop_token_ids") or []],
                stop=_str_list(d.get("stop")),
                ignore_eos=bool(d.get("ignore_eos", False)),
                seed=None if d.get("seed") is None else int(d["seed"]),
            )
        except (TypeError, ValueError) as e:
            raise RequestError(f"bad sampling_params: {e}") from e
        if p.max_new_tokens < 0:
            raise RequestError("max_new_tokens must be >= 0")
        if p.temperature < 0:
            raise RequestError("temperature must be >= 0")
        if not 0 < p.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]")
        return p


@dataclass
class GenRequest:
    input_ids: list[int]
    params: SamplingParams
    # The batcher sets it on arrival (see Batcher.submit).
    seed: int = 0
    rid: str = ""
    top_logprobs_num: int = 0


@dataclass
class GenResult:
    output_ids: list[int]
    logprobs: list[float]
    # Per output position: [(token_id, logprob), ...] best first, when top_logprobs_num > 0.
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: dict[str, Any]
    text: str
    prompt_tokens: int
    # The weights that produced it; the batcher fills it in.
    weight_version: str = ""


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
        sp = SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True)
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

    def swap_weights(self, state: dict[str, Any], path: str | Path) -> None:
        """Install weights from `read_weights`. Call only between batches."""
        self.model.load_state_dict(state, strict=True)
        self.weights_path = str(path)

    # -- text -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_request(self, req: GenRequest) -> None:
        """Reject what generation cannot do, before the request joins a batch."""
        if not req.input_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if len(req.input_ids) >= self.context_length:
            raise RequestError(
                f"the prompt has {len(req.input_ids)} tokens; the context length is "
                f"{self.context_length}"
            )

    # -- generation -------------------------------------------------------------------------

    def generate(
        self, reqs: list[GenRequest], abort: threading.Event | None = None
    ) -> list[GenResult]:
        """Decode `reqs` as one batch. Rows still running when `abort` is set end as 'abort'."""
        import torch

        with torch.inference_mode():
            return self._generate(reqs, abort)

    def _generate(self, reqs: list[GenRequest], abort: threading.Event | None) -> list[GenResult]:
        import torch

        dev = self.device
        n = len(reqs)
        rows = [_Row(r, self, dev) for r in reqs]
        steps = max(row.budget for row in rows)
        if steps == 0:
            return [row.result(self) for row in rows]

        width = max(len(r.input_ids) for r in reqs)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.input_ids) :] = torch.tensor(r.input_ids)
            mask[i, width - len(r.input_ids) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)

        temps = torch.tensor([r.params.temperature for r in reqs], device=dev)
        greedy = temps < GREEDY_TEMPERATURE
        temps = torch.where(greedy, torch.ones_like(temps), temps)
        top_k = [r.params.top_k for r in reqs]
        top_p = [r.params.top_p for r in reqs]
        top_n = max(r.top_logprobs_num for r in reqs)

        logits, cache = self._forward(ids, mask, positions, None)
        for _ in range(steps):
            logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)
            tokens = self._sample(logits / temps[:, None], greedy, top_k, top_p, rows)
            chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
            tops = logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1) if top_n else None
            token_list = tokens.tolist()
            for i, row in enumerate(rows):
                if row.finished is None:
                    top = None
                    if tops is not None and row.req.top_logprobs_num:
                        k = row.req.top_logprobs_num
                        top = list(
                            zip(
                                tops.indices[i, :k].tolist(),
                                tops.values[i, :k].tolist(),
                                strict=True,
                            )
                        )
                    row.push(token_list[i], chosen[i], top, self)
            if all(row.finished is not None for row in rows):
                break
            if abort is not None and abort.is_set():
                for row in rows:
                    if row.finished is None:
                        row.finished = {"type": "abort", "message": "aborted"}
                break
            feed = torch.tensor(
                [
                    t if row.finished is None else self.pad_token_id
                    for t, row in zip(token_list, rows, strict=True)
                ],
                device=dev,
            )[:, None]
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], dim=1)
            positions = positions[:, -1:] + 1
            logits, cache = self._forward(feed, mask, positions, cache)
        return [row.result(self) for row in rows]

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

    def _sample(
        self, scaled: Any, greedy: Any, top_k: list[int], top_p: list[float], rows: list[_Row]
    ) -> Any:
        import torch

        vocab = scaled.shape[-1]
        filtered = scaled
        if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=scaled.device)
            ranks = torch.arange(vocab, device=scaled.device)[None, :]
            drop = ranks >= ks[:, None]
            probs = sorted_logits.softmax(dim=-1)
            # A row without top-p gets a bound its cumulative mass never reaches, even rounded.
            ps = torch.tensor(
                [p if p < 1.0 else 2.0 for p in top_p], device=scaled.device, dtype=probs.dtype
            )
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop |= (probs.cumsum(dim=-1) - probs) >= ps[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            filtered = torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)
        probs = filtered.softmax(dim=-1)
        argmax = scaled.argmax(dim=-1)
        picks = []
        greedy_rows = greedy.tolist()
        for i, row in enumerate(rows):
            if greedy_rows[i] or row.finished is not None:
                picks.append(argmax[i])
            else:
                picks.append(torch.multinomial(probs[i], 1, generator=row.generator)[0])
        return torch.stack(picks)


class _Row:
    """One request's progress through a batch."""

    def __init__(self, req: GenRequest, engine: Engine, device: str):
        import torch

        self.req = req
        p = req.params
        room = engine.context_length - len(req.input_ids)
        self.budget = max(0, min(p.max_new_tokens, room))
        self.stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            self.stop_ids |= engine.eos_token_ids
        self.generator = torch.Generator(device=device).manual_seed(req.seed)
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.text: str | None = None
        self.finished: dict[str, Any] | None = (
            {"type": "length", "length": 0} if self.budget == 0 else None
        )

    def push(
        self, token: int, logprob: float, top: list[tuple[int, float]] | None, engine: Engine
    ) -> None:
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            self.top_logprobs.append(top)
        if token in self.stop_ids:
            self.finished = {"type": "stop", "matched": token}
            return
        if self.req.params.stop:
            text = engine.decode(self.output_ids)
            for s in self.req.params.stop:
                at = text.find(s)
                if at >= 0:
                    self.text = text[:at]
                    self.finished = {"type": "stop", "matched": s}
                    return
        if len(self.output_ids) >= self.budget:
            self.finished = {"type": "length", "length": len(self.output_ids)}

    def result(self, engine: Engine) -> GenResult:
        text = self.text if self.text is not None else engine.decode(self.output_ids)
        return GenResult(
            output_ids=self.output_ids,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            finish_reason=self.finished or {"type": "abort", "message": "aborted"},
            text=text,
            prompt_tokens=len(self.req.input_ids),
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


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _str_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]
