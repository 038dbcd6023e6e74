"""Packed training batches: several documents per row, each with its own positions and document id.

`PackedBatch` is what the trainer feeds to `dflash_step`. Every tensor is [B, S]:
- input_ids (long): token ids; padding slots hold `pad_token_id` (never read as a label or anchor).
- position_ids (long): position inside the document, restarting at 0 for each document (RoPE and the
  target's block-diagonal mask both rely on it); padding continues counting from 0 so no slot is odd.
- document_ids (int32): 0, 1, 2, ... per document within the row; -1 marks padding.
- loss_mask (bool): tokens the drafter is trained to predict (assistant completions).

`pack_row` is the one packing primitive (whole documents, in order, truncated to fit) shared by the test
helper `pack_documents` and the streaming packer of the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

PAD_DOCUMENT = -1


@dataclass(frozen=True)
class PackedBatch:
    """One batch of packed rows; all four tensors have shape [B, S]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    loss_mask: torch.Tensor

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        if self.input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(shape)}")
        for f in fields(self):
            t = getattr(self, f.name)
            if t.shape != shape:
                raise ValueError(f"{f.name} has shape {tuple(t.shape)}, input_ids has {tuple(shape)}")
        if self.loss_mask.dtype not in (torch.bool, torch.uint8):
            raise ValueError(f"loss_mask must be bool or uint8, got {self.loss_mask.dtype}")

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, sequence length)."""
        return (int(self.input_ids.shape[0]), int(self.input_ids.shape[1]))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """The same batch on `device`."""
        return PackedBatch(
            **{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)}
        )

    def rows(self, start: int, end: int) -> PackedBatch:
        """Rows start..end-1 of the batch."""
        return PackedBatch(**{f.name: getattr(self, f.name)[start:end] for f in fields(self)})

    def pin_memory(self) -> PackedBatch:
        """The same batch in page-locked memory (for asynchronous host-to-GPU copies)."""
        return PackedBatch(**{f.name: getattr(self, f.name).pin_memory() for f in fields(self)})

    def num_loss_tokens(self) -> int:
        """Number of loss-masked tokens (not padding)."""
        return int((self.loss_mask.bool() & (self.document_ids != PAD_DOCUMENT)).sum())


@dataclass(frozen=True)
class PackedRow:
    """One packed row as plain lists (length = max_length) and the number of documents it holds."""

    input_ids: list[int]
    position_ids: list[int]
    document_ids: list[int]
    loss_mask: list[bool]
    num_documents: int


def pack_row(
    docs: Sequence[tuple[Sequence[int], Sequence[bool | int]]],
    max_length: int,
    pad_token_id: int = 0,
    truncate: bool = True,
) -> PackedRow:
    """Pack `docs` ((ids, mask) pairs) in order into one row of exactly `max_length` tokens.

    A document that does not fit is truncated when `truncate` (its tail is dropped; nothing after it is
    packed), otherwise a ValueError names it. Empty documents are skipped. Padding has document id -1 and
    loss mask False.
    """
    ids: list[int] = []
    pos: list[int] = []
    doc: list[int] = []
    mask: list[bool] = []
    n_docs = 0
    for index, (doc_ids, doc_mask) in enumerate(docs):
        if len(doc_ids) != len(doc_mask):
            raise ValueError(f"document {index}: {len(doc_ids)} ids but {len(doc_mask)} mask entries")
        if not doc_ids:
            continue
        room = max_length - len(ids)
        if room <= 0:
            raise ValueError(f"document {index} does not fit: row of {max_length} tokens is already full")
        take = len(doc_ids)
        if take > room:
            if not truncate:
                raise ValueError(f"document {index} has {take} tokens, only {room} left in a row of {max_length}")
            take = room
        ids.extend(int(t) for t in doc_ids[:take])
        pos.extend(range(take))
        doc.extend([n_docs] * take)
        mask.extend(bool(m) for m in doc_mask[:take])
        n_docs += 1
    pad = max_length - len(ids)
    ids.extend([pad_token_id] * pad)
    pos.extend(range(pad))
    doc.extend([PAD_DOCUMENT] * pad)
    mask.extend([False] * pad)
    return PackedRow(ids, pos, doc, mask, n_docs)


def stack_rows(rows: Sequence[PackedRow]) -> PackedBatch:
    """A PackedBatch of equally long rows."""
    if not rows:
        raise ValueError("no rows to stack")
    return PackedBatch(
        input_ids=torch.tensor([r.input_ids for r in rows], dtype=torch.long),
        position_ids=torch.tensor([r.position_ids for r in rows], dtype=torch.long),
        document_ids=torch.tensor([r.document_ids for r in rows], dtype=torch.int32),
        loss_mask=torch.tensor([r.loss_mask for r in rows], dtype=torch.bool),
    )


def pack_documents(
    docs: Sequence[tuple[Sequence[int], Sequence[bool | int]]],
    max_length: int,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Greedy packing for tests: fill rows in order, start a new row when the next document does not fit.

    Documents longer than `max_length` are truncated to it. Returns a [rows, max_length] batch.
    """
    rows: list[PackedRow] = []
    current: list[tuple[Sequence[int], Sequence[bool | int]]] = []
    used = 0
    for doc_ids, doc_mask in docs:
        n = min(len(doc_ids), max_length)
        if n == 0:
            continue
        if used + n > max_length and current:
            rows.append(pack_row(current, max_length, pad_token_id))
            current, used = [], 0
        current.append((doc_ids[:n], doc_mask[:n]))
        used += n
    if current:
        rows.append(pack_row(current, max_length, pad_token_id))
    return stack_rows(rows)
