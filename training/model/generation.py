"""Greedy and beam-search decoding with a key/value cache for `T5ForConditionalGeneration`.

Output convention is HF's: each row starts with decoder_start_token_id, then the generated tokens;
a row that produced EOS is padded with pad_token_id afterwards, and decoding stops once every row
has finished or max_new_tokens were produced. `tokenizer.batch_decode(out, skip_special_tokens=True)`
gives the text.

Beam search follows transformers' (5.x) `generate(num_beams=k, do_sample=False)` with its defaults
(`early_stopping=False`, `length_penalty`), so the same weights give the same tokens (tested):

- Each step scores every (beam, token) continuation by its summed log-probability and keeps the
  best 2k (a beam proposes EOS at most once, so at least k of them continue).
- Of those, the ones in the first k that end in EOS (every one of the first k at the last step)
  become finished hypotheses, scored by summed log-probability / generated length ** length_penalty
  (EOS counted); each row keeps its k best. The best k that did not end continue.
- A row stops taking hypotheses once it holds k of them and its best running beam, normalised by
  the current length, no longer beats the worst of them (HF's heuristic for early_stopping=False);
  decoding ends when no row can improve or after max_new_tokens.
- The result is each row's best finished hypothesis.
"""

from __future__ import annotations

import functools
import warnings

import torch


def _decode_step(model, step_input, encoder_out, attention_mask, caches) -> torch.Tensor:
    """(rows, vocab) logits of the next token after `step_input` (rows, 1), written into the caches
    at their position."""
    hidden = model.decoder(
        step_input, encoder_hidden_states=encoder_out, encoder_attention_mask=attention_mask, caches=caches
    )
    return model.lm_head(model.head_input(hidden[:, -1]))


@torch.no_grad()
def greedy_generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 128,
    cuda_graph: bool = True,
) -> torch.Tensor:
    """(batch, <= 1 + max_new_tokens) LongTensor of greedy tokens; see the module docstring.

    The decoder's self-attention cache has a fixed size (max_new_tokens slots, the position a device
    tensor), so every decoding step runs the same kernels on the same buffers. On CUDA with
    `cuda_graph` the first step runs eagerly (it builds the caches and compiles what needs compiling)
    and the rest replay it as one CUDA graph: a step then costs the GPU time of its kernels instead
    of the host's time to launch them one by one (docs/performance.md has the figures)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    config = model.config
    device = input_ids.device
    was_training = model.training
    model.eval()
    try:
        encoder_out = model.encoder(input_ids, attention_mask)
        batch = input_ids.shape[0]
        position = torch.zeros((), dtype=torch.long, device=device)  # the position being decoded
        caches = _fixed_caches(model, position, max_new_tokens)
        out = torch.full((batch, 1 + max_new_tokens), config.pad_token_id, dtype=torch.long, device=device)
        out[:, 0] = config.decoder_start_token_id
        token = out[:, :1].clone()  # this step's input
        finished = torch.zeros(batch, dtype=torch.bool, device=device)

        def step() -> None:  # device work only (no host sync), so that it can be captured
            logits = _decode_step(model, token, encoder_out, attention_mask, caches)
            next_token = torch.where(finished, config.pad_token_id, logits.argmax(dim=-1))
            out.index_copy_(1, position.view(1) + 1, next_token[:, None])
            finished.logical_or_(next_token == config.eos_token_id)
            token.copy_(next_token[:, None])
            position.add_(1)

        steps = _run_steps(step, lambda: bool(finished.all()), device, max_new_tokens, cuda_graph)
        return out[:, : 1 + steps]
    finally:
        model.train(was_training)


def _fixed_caches(model, position: torch.Tensor, length: int) -> list[dict]:
    """One fixed-size cache dict per decoder block (`t5._write_cache_slot`): `length` self-attention
    slots, written at `position`; the first step makes the buffers and the cross-attention k/v."""
    return [{"position": position, "length": length} for _ in model.decoder.block]


def _run_steps(step, done, device: torch.device, max_new_tokens: int, cuda_graph: bool) -> int:
    """Runs step() until done() (a host sync, after each step) or max_new_tokens times; returns the
    number of steps run. step must do device work only, on state it updates in place. On CUDA with
    cuda_graph the first step runs eagerly (it makes the caches and compiles what needs compiling)
    and the rest replay it as one CUDA graph."""
    run = step
    graph = cuda_graph and device.type == "cuda" and max_new_tokens > 1
    if graph:  # the first step eagerly, on the stream the capture will use
        stream = _capture_stream(device)
        run = functools.partial(_run_on, stream, step)
    steps = 0
    for steps in range(1, max_new_tokens + 1):
        run()
        if done():
            break
        if steps == 1 and graph:
            run = _captured(step, stream)
    return steps


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that decoding warms up and captures on, one per device (one, so that the
    blocks the caching allocator holds for it are reused by the next batch's caches)."""
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def _run_on(stream: torch.cuda.Stream, fn) -> None:
    """fn on `stream`, ordered after the current stream's work and before its next. Warm-up belongs on
    the capture stream: what is made lazily per stream (cuBLAS workspaces) then exists before the
    capture."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)


def _captured(fn, stream: torch.cuda.Stream):
    """fn (which must have run once on `stream`) captured as a CUDA graph; returns the graph's replay,
    which runs on the current stream. What fn allocates lives in the graph's pool, freed with it.

    If the capture fails (an op that syncs with the host or cannot be captured, e.g. in an attention
    backend other than the tested `triton`, `sdpa` and `math`), returns fn itself with a warning:
    capturing runs no kernel, so nothing was decoded twice or skipped."""
    graph = torch.cuda.CUDAGraph()
    rng = torch.cuda.default_generators[stream.device.index]
    rng_state = rng.clone_state()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.graph(graph, stream=stream):
            fn()
    except RuntimeError as e:
        # A failed capture leaves the device's default generator in capture mode, and the next random
        # op would raise: give it back its state from before the capture.
        rng.graphsafe_set_state(rng_state)
        warnings.warn(
            f"decoding could not be captured as a CUDA graph ({type(e).__name__}: {str(e)[:200]}); "
            "it goes on with eager steps. Pass cuda_graph=False to generate() to skip the attempt.",
            stacklevel=3,
        )
        return fn
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay


def _pick(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values[b, index[b, j], ...] for (batch, n, ...) values and (batch, m) index."""
    return values.gather(
        1, index.view(*index.shape, *([1] * (values.dim() - 2))).expand(-1, -1, *values.shape[2:])
    )


@torch.no_grad()
def beam_search_generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 128,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    cuda_graph: bool = True,
) -> torch.Tensor:
    """(batch, <= 1 + max_new_tokens) LongTensor: each row's best beam; see the module docstring.

    Decodes as `greedy_generate` does: a fixed-size self-attention cache and, on CUDA with
    `cuda_graph`, every step after the first replayed as one CUDA graph. A step's bookkeeping (the
    top-k, the finished hypotheses, the caches' history table that follows the beams) is device
    work on buffers updated in place, so it is in the graph too; the host only reads, after each
    step, whether any row can still improve."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1 (1 is greedy decoding), got {num_beams}")
    config = model.config
    batch, k, device = input_ids.shape[0], num_beams, input_ids.device
    was_training = model.training
    model.eval()
    try:
        # Every beam of a row attends to that row's encoder output: rows are (batch * k), the k beams
        # of an input consecutive. The encoder output stays at one row per input: the cross-attention
        # computes its k/v once per input and reads them once for the input's k beams (`T5Attention`),
        # and they never need reordering.
        encoder_out = model.encoder(input_ids, attention_mask)
        position = torch.zeros((), dtype=torch.long, device=device)  # tokens generated before this step
        caches = _fixed_caches(model, position, max_new_tokens)
        rows = torch.arange(batch * k, device=device)
        slots = torch.arange(max_new_tokens, device=device)
        # Flat indices (row * max_new_tokens + slot) into the caches' buffers: each row's own
        # slots, until beams move (`t5._write_cache_slot`).
        own_slots = rows[:, None] * max_new_tokens + slots
        history = own_slots.clone()
        for cache in caches:
            cache["history"] = history
        width = 1 + max_new_tokens
        running = torch.full((batch, k, width), config.pad_token_id, dtype=torch.long, device=device)
        running[:, :, 0] = config.decoder_start_token_id
        # Summed log-probabilities of the running beams. Only beam 0 starts live, so the first step
        # does not propose the same continuation k times.
        running_scores = torch.full((batch, k), float("-inf"), device=device)
        running_scores[:, 0] = 0.0
        finished = running.clone()  # each row's k best finished hypotheses so far
        finished_scores = torch.full((batch, k), float("-inf"), device=device)
        can_improve = torch.ones(batch, dtype=torch.bool, device=device)
        first_k = torch.arange(2 * k, device=device) < k
        row_offset = torch.arange(batch, device=device)[:, None] * k
        step_input = running[:, :, 0].reshape(batch * k, 1).clone()  # a buffer of its own, not a view
        # generated length ** length_penalty after each step: the values HF divides by (Python floats,
        # fp32 here), in a table indexed by the device position
        length_norm = torch.tensor([float(n) ** length_penalty for n in range(1, width)], device=device)

        def step() -> None:  # device work only (no host sync), so that it can be captured
            column = (position + 1).view(1)  # where this step's token goes in the sequences
            norm = length_norm.index_select(0, position.view(1))  # not length_norm[position]: a host read
            logits = _decode_step(model, step_input, encoder_out, attention_mask, caches).float()
            vocab = logits.shape[-1]
            scores = torch.log_softmax(logits, dim=-1).view(batch, k, vocab) + running_scores[:, :, None]
            top_scores, top_index = scores.view(batch, k * vocab).topk(2 * k, dim=1)  # sorted, best first
            top_beam, top_token = top_index // vocab, top_index % vocab
            top_seqs = _pick(running, top_beam).index_copy_(2, column, top_token[:, :, None])
            ends = (top_token == config.eos_token_id) | (column == max_new_tokens)  # the last step ends all

            # Finished hypotheses: candidates among the best k that end here, length-normalised.
            new_scores = (top_scores / norm).masked_fill(~(ends & first_k & can_improve[:, None]), float("-inf"))
            merged_scores = torch.cat([finished_scores, new_scores], dim=1)
            keep = merged_scores.topk(k, dim=1).indices
            finished.copy_(_pick(torch.cat([finished, top_seqs], dim=1), keep))
            finished_scores.copy_(_pick(merged_scores, keep))

            # The best k candidates that did not end continue; their caches follow them (after the
            # last step nothing continues, and what this does there is never read).
            cont = top_scores.masked_fill(ends, float("-inf")).topk(k, dim=1).indices
            running.copy_(_pick(top_seqs, cont))
            running_scores.copy_(_pick(top_scores, cont))
            # The caches' rows stay where they are: the history table follows the beams instead
            # (`t5._write_cache_slot`). Slots up to this step's come from the source beam's row;
            # later slots will be written by the row itself.
            source_rows = (_pick(top_beam, cont) + row_offset).view(-1)
            history.copy_(torch.where(slots <= position, history.index_select(0, source_rows), own_slots))
            step_input.copy_(running.index_select(2, column).view(batch * k, 1))

            # HF's early_stopping=False heuristic: a row with k hypotheses whose best running beam,
            # normalised by the current length, does not beat its worst one is done for good.
            full = torch.isfinite(finished_scores).all(dim=1)
            worst = torch.where(full, finished_scores.min(dim=1).values, float("-inf"))
            can_improve.logical_and_(running_scores[:, 0] / norm > worst)
            position.add_(1)

        _run_steps(step, lambda: not bool(can_improve.any()), device, max_new_tokens, cuda_graph)

        # A hypothesis ends at its only EOS (pad after it) or at the last column; cut the columns
        # that no row's best hypothesis reached.
        best = finished[:, 0]
        is_eos = best[:, 1:] == config.eos_token_id
        lengths = torch.where(is_eos.any(dim=1), is_eos.long().argmax(dim=1) + 2, width)
        return best[:, : int(lengths.max())]
    finally:
        model.train(was_training)
