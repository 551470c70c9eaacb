"""Token-text-dependent tables the sampler needs: DRY sequence breakers and the tokens XTC
never removes. Built once per distinct setting and kept by the `Sampler` instance."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class VocabTables:
    """Lazily built, cached token tables.

    vocab_size: number of real tokens.
    token_pieces: the text of every token id, or None (then only integer breakers work).
    eos_token_ids: tokens XTC never removes.
    """

    def __init__(
        self, vocab_size: int, token_pieces: Sequence[str] | None, eos_token_ids: Sequence[int]
    ) -> None:
        self.vocab_size = vocab_size
        self._pieces = list(token_pieces)[:vocab_size] if token_pieces is not None else None
        self._eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self._breakers: dict[tuple[str | int, ...], np.ndarray] = {}
        self._breakers_on: dict[tuple[tuple[str | int, ...], torch.device], torch.Tensor] = {}
        self._protected: dict[torch.device, torch.Tensor] = {}

    def breakers(self, breakers: tuple[str | int, ...]) -> np.ndarray:
        """Bool ``[vocab]``: True for tokens that are DRY sequence breakers. A string breaker
        matches every token whose text contains it; an int is a token id."""
        table = self._breakers.get(breakers)
        if table is None:
            table = np.zeros(self.vocab_size, dtype=bool)
            table[[b for b in breakers if isinstance(b, int) and b < self.vocab_size]] = True
            texts = [b for b in breakers if isinstance(b, str)]
            if texts:
                pieces = self._need_pieces("DRY string sequence breakers")
                table |= np.array([any(t in p for t in texts) for p in pieces] +
                                  [False] * (self.vocab_size - len(pieces)), dtype=bool)
            self._breakers[breakers] = table
        return table

    def breaker_tables(
        self, per_row: Sequence[tuple[str | int, ...]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For rows with the given breaker settings: bool ``[distinct settings, vocab]`` tables
        on ``device`` and the int64 ``[rows]`` index of each row's table."""
        distinct = list(dict.fromkeys(per_row))
        tables = []
        for breakers in distinct:
            table = self._breakers_on.get((breakers, device))
            if table is None:
                table = torch.from_numpy(self.breakers(breakers)).to(device)
                self._breakers_on[(breakers, device)] = table
            tables.append(table)
        which = [distinct.index(b) for b in per_row]
        return torch.stack(tables), torch.tensor(which, dtype=torch.int64, device=device)

    def xtc_protected(self, device: torch.device) -> torch.Tensor:
        """Bool ``[vocab]`` on ``device``: newline tokens (when token texts are known) and EOS."""
        table = self._protected.get(device)
        if table is None:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            if self._pieces is not None:
                mask[[t for t, p in enumerate(self._pieces) if "\n" in p]] = True
            mask[self._eos] = True
            table = self._protected[device] = mask.to(device)
        return table

    def _need_pieces(self, what: str) -> list[str]:
        if self._pieces is None:
            raise ValueError(
                f"{what} need the token texts: build the Sampler with token_pieces=..., or give "
                "dry_sequence_breakers as token ids"
            )
        return self._pieces
