"""``LanguageModel``: a decoder-only LM over any registered mixers, with recurrent-state decoding.

Dimension legend: B batch, T tokens, V vocabulary, d d_model.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn

from .. import state_tree
from .._checks import (
    Documents,
    check_cu_seqlens_tensor,
    check_documents,
    documents_from,
    is_int,
    is_number,
)
from .._files import CHECKSUM_FILE, CONFIG_FILE, WEIGHTS_FILE, listing_problem, write_checksums
from ..layers.base import token_positions
from ..ops import reading_nothing, reads_allowed
from .block import Block, MixerRunner, make_norm
from .config import LMConfig
from .graph import DecodeGraph

# One layer state per block, in order; with an absolute position encoding (LMConfig.position)
# one more item last: the tokens each sequence has consumed (a long tensor [B], or [N] per
# document with cu_seqlens), where its next positions start.
LMState = list[Any]
_logger = logging.getLogger(__name__)


class LanguageModel(nn.Module):
    """Token embedding -> ``n_layers`` pre-norm blocks -> final norm -> logits (LMConfig).

    ``forward(input_ids [B, T] long, state=None) -> (logits [B, T, V], state)``: ``state`` is a
    list with every layer's recurrent state (None = start of sequence), followed by the position
    offsets [B] when ``config.position`` is not ``"none"`` (``LMState``); feeding a sequence in
    pieces with the state carried gives the logits of feeding it whole. ``generate`` prefills the
    prompt in one forward and then decodes one token per step from the carried state.

    ``gradient_checkpointing`` (off by default; ``set_gradient_checkpointing``) trades compute
    for memory in training: each block keeps only its input for the backward pass and runs its
    forward again there, so activation memory holds one block's intermediates instead of
    ``n_layers`` of them. It applies in training mode with gradients enabled; results, gradients
    and random draws (dropout, FAVOR+ redraws) are those of the plain forward. With
    ``every_n_layers=n`` only blocks 0, n, 2n, ... recompute (transformers' convention), trading
    memory back for speed.
    """

    #: Recompute each block's activations in the backward pass (see the class docstring). The
    #: name is the attribute Hugging Face's ``gradient_checkpointing_enable`` sets.
    gradient_checkpointing: bool = False

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        if not isinstance(config, LMConfig):
            raise TypeError(f"config must be an LMConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.pos_embed = (nn.Embedding(config.max_seq_len, config.d_model)
                          if config.position == "learned" else None)
        self.blocks = nn.ModuleList(
            Block(config, name, opts)
            for name, opts in zip(config.layer_mixers(), config.layer_options())
        )
        self.norm = make_norm(config)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Small embedding init (GPT-2's 0.02) keeps tied output logits near uniform at start.
        nn.init.normal_(self.embed.weight, std=0.02)
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed.weight, std=0.02)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.gradient_checkpointing = False
        self.checkpoint_every = 1
        self._gradient_checkpointing_func: Callable[..., Any] | None = None

    def set_gradient_checkpointing(self, enable: bool = True, *,
                                   every_n_layers: int = 1) -> LanguageModel:
        """Switch activation recomputation in the backward pass on or off, for every
        ``every_n_layers``-th block (0, n, 2n, ...); returns the model."""
        if not isinstance(enable, bool):
            raise TypeError(f"enable must be a bool, got {enable!r}")
        if not is_int(every_n_layers) or every_n_layers < 1:
            raise ValueError(f"every_n_layers must be an int >= 1, got {every_n_layers!r}")
        self.gradient_checkpointing = enable
        self.checkpoint_every = int(every_n_layers)
        return self

    def set_mixer_runner(self, runner: MixerRunner | None) -> LanguageModel:
        """Make every block call its mixer through ``runner(mixer, x, state, cu_seqlens) ->
        (y, state)`` (None: directly, the default); returns the model. Context-parallel training
        installs one that runs each mixer on this process's shard of the sequence
        (``fastweights.parallel.context_parallel_forward``); the embeddings, norms,
        feed-forwards and head are per token and run on the shard as they are."""
        if runner is not None and not callable(runner):
            raise TypeError(f"runner must be callable or None, got {type(runner).__name__}")
        for block in self.blocks:
            block.mixer_runner = runner
        return self

    def set_inner_lr_warmup(self, progress: float) -> None:
        """Tell every layer how far the outer warm-up has come (``progress`` in [0, 1], 1 once
        warmed up); layers with an inner learning-rate schedule (TTT-MLP, docs/maths.md 2.6) follow
        it."""
        if not is_number(progress) or not 0.0 <= progress <= 1.0:
            raise ValueError(f"progress must be a number in [0, 1], got {progress!r}")
        for block in self.blocks:
            block.mixer.set_inner_lr_warmup(float(progress))

    def _check_ids(self, input_ids: Any, name: str = "input_ids",
                   cu_seqlens: Any = None) -> Documents | None:
        """Check ``input_ids`` (and ``cu_seqlens``, returned as ``Documents``): the ids' range
        and the documents' boundaries are read back to the host together, once."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
        if input_ids.dtype != torch.long:
            raise TypeError(f"{name} must have dtype torch.long, got {input_ids.dtype}")
        if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
            raise ValueError(f"{name} must have shape [B, T] with B, T >= 1, got {tuple(input_ids.shape)}")
        V = self.config.vocab_size
        B, T = input_ids.shape
        # The range check reads the ids' values, a data-dependent branch that torch.export and
        # torch.compile(fullgraph=True) cannot trace; traced programs leave it to the embedding
        # lookup, which fails on an out-of-range id (IndexError on CPU, a device assert on CUDA).
        if torch.compiler.is_compiling():
            return None if cu_seqlens is None else check_documents(
                cu_seqlens, T, B, input_ids.device)
        reads = [torch.stack(torch.aminmax(input_ids))]
        if isinstance(cu_seqlens, torch.Tensor):
            reads.append(check_cu_seqlens_tensor(cu_seqlens, B, input_ids.device).to(torch.long))
        values = torch.cat(reads).tolist()  # one read back to the host for everything
        lo, hi = values[:2]
        if lo < 0 or hi >= V:
            raise ValueError(f"{name} must hold ids in [0, {V}), got values in [{lo}, {hi}]")
        if cu_seqlens is None:
            return None
        if isinstance(cu_seqlens, torch.Tensor):
            return documents_from(values[2:], cu_seqlens, T)
        return check_documents(cu_seqlens, T, B, input_ids.device)

    def _check_length(self, total: int) -> None:
        limit = self.config.max_seq_len
        if limit is not None and total > limit:
            raise ValueError(
                f"sequence length {total} exceeds the model's max_seq_len {limit}"
            )

    def forward(
        self, input_ids: torch.Tensor, state: LMState | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LMState]:
        """Logits for ``input_ids`` [B, T]; see the class docstring. With ``cu_seqlens``
        ([N + 1] boundaries of documents packed in a batch of one) every layer resets its state
        at each boundary, and each layer's state is a list with one state per document."""
        h, state = self.hidden(input_ids, state, cu_seqlens)
        return self.head(h), state  # [B, T, V]

    def hidden(
        self, input_ids: torch.Tensor, state: LMState | None = None,
        cu_seqlens: torch.Tensor | None = None, *, collect: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, LMState]:
        """``forward`` without the output head: the final norm's output h [B, T, d] (the logits
        are ``head(h)``) and the state. With ``collect`` (a list), appends ``n_layers + 1``
        tensors [B, T, d], the convention of transformers' ``output_hidden_states`` (Llama's):
        the input of every block (the first is the embeddings' output after dropout) and, last,
        the final norm's output h itself (after the norm)."""
        cu_seqlens = self._check_ids(input_ids, cu_seqlens=cu_seqlens)  # Documents, checked once
        if cu_seqlens is not None:
            bounds = cu_seqlens.bounds
            if state is None:
                self._check_length(max(b - a for a, b in itertools.pairwise(bounds)))
        elif state is None:
            self._check_length(input_ids.shape[1])
        return self._run(input_ids, self._check_state(state), cu_seqlens, collect)

    def _check_state(self, state: LMState | None) -> LMState:
        """A carried model state (a list with one state per block, then the position offsets
        where the model has them), or the empty one for None."""
        n_state = len(self.blocks) + (self.config.position != "none")
        if state is None:
            return [None] * n_state
        if not isinstance(state, (list, tuple)) or len(state) != n_state:
            raise ValueError(
                f"state must be None or a list of {len(self.blocks)} layer states"
                f"{' and then the position offsets' if n_state > len(self.blocks) else ''} "
                f"(as returned by forward), got {type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, (list, tuple)) else "")
            )
        return state

    def step(self, input_ids: torch.Tensor, state: LMState) -> tuple[torch.Tensor, LMState]:
        """One decoding token per row, ``input_ids`` [B, 1] long, continuing ``state`` (one
        ``forward`` returned, or its ``static_state``): (logits [B, 1, V], the state after it).
        ``forward`` for T = 1 without reading anything back to the host: the ids' range is not
        checked (an id outside the vocabulary fails in the embedding lookup), and every layer
        runs its one-token step under ``reading_nothing`` (docs/design.md, "Host reads"). What
        ``generate`` captures in a CUDA graph (models/graph.py)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long \
                or input_ids.dim() != 2 or input_ids.shape[1] != 1:
            got = (f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(
                input_ids, torch.Tensor) else type(input_ids).__name__)
            raise ValueError(f"input_ids must be a long tensor [B, 1] (one token per row), "
                             f"got {got}")
        with reading_nothing():
            h, state = self._run(input_ids, self._check_state(state), None, None)
        return self.head(h), state

    def static_state(self, state: LMState, max_len: int) -> LMState:
        """``state`` (one ``forward`` returned) in the form a decoding step captured in a CUDA
        graph continues, every layer's ``static_state`` with caches of ``max_len`` tokens
        (docs/design.md, "Decoding graphs"); TypeError naming the first mixer without one,
        ValueError where this state has none."""
        state = self._check_state(state)
        layers = [block.mixer.static_state(s, max_len) for block, s in zip(self.blocks, state)]
        return layers + list(state[len(self.blocks):])

    def _run(self, input_ids: torch.Tensor, state: LMState, cu_seqlens: Documents | None,
             collect: list[torch.Tensor] | None) -> tuple[torch.Tensor, LMState]:
        """``hidden`` past its checks."""
        x = self.embed(input_ids)  # [B, T, d]
        new_state: LMState = []
        if self.config.position != "none":
            positions, offsets = self._positions(input_ids, state[-1], cu_seqlens)
            x = x + self._position_encoding(positions).to(x.dtype)
        x = self.drop(x)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        run = (self._gradient_checkpointing_func or _checkpoint) if recompute else None
        for i, (block, s) in enumerate(zip(self.blocks, state)):
            if collect is not None:
                collect.append(x)
            if run is not None and i % self.checkpoint_every == 0:
                x, s = _checkpointed_block(run, block, x, s, cu_seqlens)
            else:
                x, s = block(x, s, cu_seqlens)
            new_state.append(s)
        if self.config.position != "none":
            new_state.append(offsets)
        h = self.norm(x)  # [B, T, d]
        if collect is not None:
            collect.append(h)
        return h, new_state

    def _positions(self, input_ids: torch.Tensor, offsets: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Absolute positions of ``input_ids``'s tokens ([B, T], or [1, T] for a packed batch)
        counting on from ``offsets`` (the state's; zeros when None), and the offsets after them."""
        B, T = input_ids.shape
        device = input_ids.device
        if cu_seqlens is None:
            n = B
            lengths = torch.full((B,), T, dtype=torch.long, device=device)
        else:
            bounds = cu_seqlens.bounds
            n = len(bounds) - 1
            lengths = torch.tensor([b - a for a, b in itertools.pairwise(bounds)], device=device)
        if offsets is None:
            offsets = torch.zeros(n, dtype=torch.long, device=device)
        elif not (isinstance(offsets, torch.Tensor) and offsets.dtype == torch.long
                  and offsets.shape == (n,)):
            got = (f"{offsets.dtype} {tuple(offsets.shape)}" if isinstance(offsets, torch.Tensor)
                   else type(offsets).__name__)
            raise ValueError(f"state[-1] (position offsets) must be a long tensor of shape [{n}], "
                             f"got {got}")
        if cu_seqlens is None:
            positions = offsets[:, None] + torch.arange(T, device=device)  # [B, T]
        else:
            positions = token_positions(bounds, offsets.tolist(), device)[None]  # [1, T]
        limit = self.config.max_seq_len
        if self.pos_embed is not None and reads_allowed() and int(positions.max()) >= limit:
            raise ValueError(f"position {int(positions.max())} is beyond the learned position "
                             f"table of max_seq_len {limit} rows")
        return positions, offsets.to(device) + lengths

    def _position_encoding(self, positions: torch.Tensor) -> torch.Tensor:
        """[..., d] encoding of integer ``positions``: the learned table's rows, or
        PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d)) times
        ``position_scale``."""
        if self.pos_embed is not None:
            return self.pos_embed(positions)
        d = self.config.d_model
        freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64, device=positions.device) / d)
        angle = positions[..., None].double() * freq  # [..., ceil(d/2)]
        pe = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)[..., :d]
        return pe * self.config.position_scale

    def stack_states(self, states: list[LMState]) -> LMState:
        """One state for a batch whose row i continues ``states[i]`` (each a state ``forward``
        returned, for a batch of one or of B_i rows, which follow in order): N streams, each at
        its own position, decoded together one token per call (``forward(ids [N, 1], state)``),
        every row's logits and state then those of decoding its stream alone. Each layer stacks
        its states (``Mixer.stack_states``: per-row positions and left-padded caches where
        needed); the position offsets stack too.

        Stacking copies the states; decoding the stacked state continues one token per call for
        the mixers whose rows keep their own places in a mini-batch, segment or block (ttt-*,
        infini, diag) or window (aft-local); softmax takes any T. ValueError when a layer cannot
        hold its streams' positions per row (aft-full at different lengths)."""
        if not isinstance(states, (list, tuple)) or not states:
            raise ValueError("states must be a non-empty list of LanguageModel states")
        n_state = len(self.blocks) + (self.config.position != "none")
        for i, state in enumerate(states):
            if not isinstance(state, (list, tuple)) or len(state) != n_state:
                raise ValueError(f"states[{i}] must be a LanguageModel state (a list of "
                                 f"{n_state} items, as forward returns), got "
                                 f"{type(state).__name__}")
        stacked: LMState = [block.mixer.stack_states([s[i] for s in states])
                            for i, block in enumerate(self.blocks)]
        if self.config.position != "none":
            stacked.append(torch.cat([s[-1] for s in states]))
        return stacked

    @torch.no_grad()
    def generate(
        self, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
        top_k: int | None = None, seed: int | None = None, graph: bool | None = None,
    ) -> torch.Tensor:
        """Continue ``prompt_ids`` ([B, T] or [T] long) by ``max_new_tokens`` tokens.

        The prompt is prefilled in one forward; every new token is then one T = 1 step on the
        carried state (constant memory per token for recurrent mixers). ``temperature`` 0 is
        greedy decoding; otherwise logits / temperature are sampled, restricted to the ``top_k``
        most likely tokens if given, with a private generator seeded by ``seed``. Returns the
        prompt followed by the new tokens, with the prompt's rank. Runs in eval mode.

        ``graph``: decode through one CUDA graph of the step, captured once and replayed per
        token (models/graph.py; docs/design.md, "Decoding graphs"). None (default): on CUDA
        when every mixer's state after the prompt has a static form, else token by token;
        True: required (ValueError on a CPU model or for a mixer without one); False: token
        by token.
        """
        squeeze = isinstance(prompt_ids, torch.Tensor) and prompt_ids.dim() == 1
        ids = prompt_ids[None] if squeeze else prompt_ids
        self._check_ids(ids, "prompt_ids")
        if not is_int(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not is_number(temperature) or not temperature >= 0 or temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if top_k is not None and (not is_int(top_k) or top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
        if seed is not None and not is_int(seed):
            raise ValueError(f"seed must be None or an int, got {seed!r}")
        if graph is not None and not isinstance(graph, bool):
            raise TypeError(f"graph must be None or a bool, got {graph!r}")
        if graph and not ids.is_cuda:
            raise ValueError(f"graph=True captures a CUDA graph: the model and prompt_ids must be "
                             f"on a CUDA device, got {ids.device}")
        self._check_length(ids.shape[1] + max_new_tokens)
        if max_new_tokens == 0:
            return prompt_ids
        gen = None
        if seed is not None:
            gen = torch.Generator(device=ids.device).manual_seed(seed)
        was_training = self.training
        self.eval()
        try:
            logits, state = self(ids)
            out = [_pick(logits[:, -1].float(), temperature, top_k, gen)]  # [B, 1]
            step = self._decoder(state, out[0], ids.shape[1] + max_new_tokens, graph)
            for _ in range(max_new_tokens - 1):
                out.append(_pick(step(out[-1])[:, -1].float(), temperature, top_k, gen))
            out.insert(0, ids)
        finally:
            self.train(was_training)
        result = torch.cat(out, dim=1)
        return result[0] if squeeze else result

    def _decoder(self, state: LMState, ids: torch.Tensor, max_len: int,
                 graph: bool | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """The function from the next ids [B, 1] to their logits [B, 1, V] that ``generate``
        decodes with: a ``DecodeGraph`` (captured on CUDA) or eager steps on the carried
        state."""
        if graph is not False and ids.is_cuda:
            try:
                return DecodeGraph(self, state, ids, max_len, capture=True)
            except (TypeError, ValueError) as err:
                if graph:
                    raise ValueError(f"graph=True: {err}") from None
                _logger.info("generate decodes token by token: %s", err)
        carried = [state]

        def eager(nxt: torch.Tensor) -> torch.Tensor:
            logits, carried[0] = self(nxt, carried[0])
            return logits

        return eager

    def num_parameters(self) -> int:
        """Trainable parameters, counting tied weights once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json``, ``model.safetensors`` and ``checksums.json`` (their sizes and
        SHA-256 digests, checked by ``from_pretrained``) into ``directory`` (created if needed)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save(directory / CONFIG_FILE)
        save_model(self, str(directory / WEIGHTS_FILE))
        write_checksums(directory, (CONFIG_FILE, WEIGHTS_FILE))

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu", *,
                        verify: bool = True) -> LanguageModel:
        """Load a folder written by ``save_pretrained``, in eval mode (as Hugging Face does; call
        ``.train()`` to fine-tune). A missing folder or file, a foreign or corrupt config or
        weights, or (with ``verify``) a file that differs from ``checksums.json`` (when the
        folder has one) raise ValueError naming the problem. ``verify=False`` skips re-hashing
        for callers that have just checked the folder themselves (the trainer's manifest)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"checkpoint folder {directory} does not exist")
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (directory / name).is_file():
                raise ValueError(f"{directory} is not a fastweights checkpoint (no {name})")
        if verify:
            _verify_checksums(directory)
        model = cls(LMConfig.load(directory / CONFIG_FILE))
        try:
            load_model(model, str(directory / WEIGHTS_FILE), strict=True, device=str(device))
        except (SafetensorError, RuntimeError, OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"cannot load weights from {directory / WEIGHTS_FILE}: {first}") from None
        return model.to(device).eval()


def _verify_checksums(directory: Path) -> None:
    """Compare config.json, model.safetensors and every other file ``checksums.json`` lists (a
    carried tokenizer) with it, if the folder has one (folders written by other tools may not);
    ValueError naming the first file that differs."""
    path = directory / CHECKSUM_FILE
    if not path.exists():
        return
    try:
        files = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path} is corrupt ({type(err).__name__}: {err})") from None
    problem = listing_problem(directory, path, files, (CONFIG_FILE, WEIGHTS_FILE))
    if problem is not None:
        raise ValueError(problem)


# Non-reentrant checkpointing by default; the RNG state is restored for the recomputation so
# dropout and FAVOR+ redraws repeat exactly. Hugging Face's gradient_checkpointing_enable may
# substitute the reentrant form (use_reentrant=True), hence _checkpointed_block.
_checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def _checkpointed_block(run: Callable[..., Any], block: nn.Module, x: torch.Tensor, state: Any,
                        cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
    """``block(x, state, cu_seqlens)`` through the checkpoint function ``run``.

    The reentrant checkpoint takes positional arguments only and tracks gradients only through
    tensors that are direct arguments and direct outputs, so the layer states (nested
    lists/tuples of tensors, ints and None) travel flattened: their tensors as positional
    arguments and outputs, their structure in this closure. Gradients through a carried state
    (in and out) are then those of the plain forward with either form of checkpointing."""
    leaves, layout = state_tree.flatten(state)
    layouts: list[state_tree.Layout] = []

    def step(x: torch.Tensor, cu_seqlens: torch.Tensor | None,
             *leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y, out = block(x, state_tree.unflatten(leaves, layout), cu_seqlens)
        out_leaves, out_layout = state_tree.flatten(out)
        layouts.append(out_layout)  # again at the recomputation; the layout is the same
        return (y, *out_leaves)

    y, *out_leaves = run(step, x, cu_seqlens, *leaves)
    return y, state_tree.unflatten(out_leaves, layouts[0])


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None,
          gen: torch.Generator | None) -> torch.Tensor:
    """Next token ids [B, 1] from last-position logits [B, V]."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
