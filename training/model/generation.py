"""Greedy decoding with a key/value cache for `T5ForConditionalGeneration`.

Output convention is HF's: each row starts with decoder_start_token_id, then the generated tokens;
a row that produced EOS is padded with pad_token_id afterwards, and decoding stops once every row
has finished or max_new_tokens were produced. `tokenizer.batch_decode(out, skip_special_tokens=True)`
gives the text.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_generate(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 128
) -> torch.Tensor:
    """(batch, <= 1 + max_new_tokens) LongTensor of greedy tokens; see the module docstring."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    config = model.config
    was_training = model.training
    model.eval()
    try:
        encoder_out = model.encoder(input_ids, attention_mask)
        batch = input_ids.shape[0]
        # One dict per decoder block: self-attention k/v grow by one position per step; cross k/v fixed.
        caches: list[dict] = [{} for _ in model.decoder.block]
        out = torch.full((batch, 1), config.decoder_start_token_id, dtype=torch.long, device=input_ids.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        step_input = out
        for step in range(max_new_tokens):
            hidden = model.decoder(
                step_input,
                encoder_hidden_states=encoder_out,
                encoder_attention_mask=attention_mask,
                caches=caches,
                past_length=step,
            )
            logits = model.lm_head(model.head_input(hidden[:, -1]))
            next_token = logits.argmax(dim=-1)
            next_token = torch.where(finished, torch.full_like(next_token, config.pad_token_id), next_token)
            out = torch.cat([out, next_token[:, None]], dim=1)
            finished |= next_token == config.eos_token_id
            if bool(finished.all()):
                break
            step_input = next_token[:, None]
        return out
    finally:
        model.train(was_training)
