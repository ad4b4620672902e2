"""What a run's data may hold for its draft method: the tokenizer's special ids no sample uses
(ids a method may reserve), the refusal of data holding an id the method reserves, and the note on
a method that learns the sequences' own tokens from the dataset's answers."""
from __future__ import annotations

import torch

from ..data.dataset import TokenizedData
from ..draft.method import DraftMethod


def _special_ids(tokenizer) -> set[int]:
    return {int(i) for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(tok, "special", False)}


def unused_special_ids(tokenizer, data: TokenizedData, end_of_turn_id: int | None = None) -> list[int]:
    """The tokenizer's special-token ids (ascending) that no sample holds, other than its bos, eos,
    pad and end-of-turn tokens: ids a draft method may reserve (`with_unused_special_tokens`)."""
    used = {int(t) for s in [*data.train, *data.heldout] for t in s.input_ids.unique().tolist()}
    return sorted(_special_ids(tokenizer) - used - {tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                    tokenizer.pad_token_id, end_of_turn_id})


def regeneration_note(method: DraftMethod, regenerate: bool) -> str | None:
    """For a training run (`regenerate`: data.regenerate): a method that learns the sequences' own
    tokens, trained on the dataset's answers."""
    if method.needs_teacher or regenerate:
        return None
    return (f"note: draft={method.name} learns the sequences' own next tokens (no teacher logits) and "
            f"data.regenerate=false: it learns the dataset's answers, not the target's; data.regenerate=true "
            f"trains it on the target's own answers (the method's recipe)")


def check_reserved_tokens(method: DraftMethod, draft_cfg, data: TokenizedData, tokenizer, regenerate: bool) -> None:
    """Refuse data that holds a token id the draft method reserves (DFlash: its mask token, which
    real input must never contain); note an id the tokenizer writes as ordinary text (a target's
    answer, data.regenerate, could still produce it)."""
    fields = method.reserved_tokens(draft_cfg)  # {"draft.<field>": id}
    reserved = sorted(set(fields.values()))
    if not reserved:
        return
    field_of = {tok: field for field, tok in fields.items()}
    held = torch.tensor(reserved)
    found = {}
    for split, samples in (("train", data.train), ("held-out", data.heldout)):
        for i, s in enumerate(samples):
            hits = torch.isin(held, s.input_ids)
            for tok in held[hits].tolist():
                found.setdefault(tok, f"{split} sample {i}")
    specials = _special_ids(tokenizer)
    if found:
        free = unused_special_ids(tokenizer, data)[-3:]
        field = field_of[min(found)]
        hint = (f"choose an id the data does not hold, e.g. a special token it never uses: {field}="
                f"{free[-1]} ({', '.join(repr(tokenizer.convert_ids_to_tokens(t)) for t in free)})" if free else
                f"choose an id the data does not hold ({field})")
        raise ValueError(f"draft={method.name} reserves token id(s) {reserved} (never in real input), but the "
                         f"data holds " + ", ".join(f"{t} ({tokenizer.convert_ids_to_tokens(t)!r}, first in the {where})"
                                                      for t, where in sorted(found.items())) + f": {hint}")
    ordinary = [t for t in reserved if t not in specials]
    if ordinary and specials and regenerate:
        print(f"note: draft={method.name} reserves token id(s) {ordinary} "
              f"({', '.join(repr(tokenizer.convert_ids_to_tokens(t)) for t in ordinary)}), ordinary text to this "
              f"tokenizer: none is in the dataset, but a regenerated answer could hold one "
              f"({', '.join(field_of[t] for t in ordinary)} picks another)", flush=True)
